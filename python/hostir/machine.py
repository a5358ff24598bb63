"""The machine model: what a program costs on this machine.

A `MachineModel` holds this machine's GEMM throughput, copy-engine push
bandwidth between peers and collective bandwidth, timed on the device only
(the queue pre-filled, so no launch gap counts), the GEMM's slowdown beside
each kind of traffic, and what a call and a ring step cost on the host per
runner (the Python evaluator, the C++ executor, or a CUDA-graph replay).
`predict_ms` predicts one call of a sequential program or a ring of some
chunks on a transport, for the runner it is given; `choose_hoisting`
compares the sequential program with posts hoisted whole or in pieces.
The model decides nothing and asks no transport whether it can run: the
planner (`hostir.planner`) names the candidates and their runners and
takes the fastest. A model is measured once per device, torch, CUDA and
GPU count and cached under `~/.cache/hostir/` (`HOSTIR_CACHE_DIR`); every
communicator on GPUs agrees on rank 0's model when it is created, so every
rank (on every node) plans the same program. CPU ranks use `CPU_MODEL`.
`python3 -m hostir machine` shows the model and re-measures it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct

import torch

from hostir import backends, communicator, ir
from hostir.lower.decompose_device_axis import fuses_reduction

# ---------------------------------------------------------------- the machine


@dataclasses.dataclass(frozen=True)
class MachineModel:
    """Measured throughputs: `gemm_tflops` (bf16 GEMM), `copy_gbps` (one-way
    push to a peer with the copy engine; 0 without P2P), `collective_gbps`
    (NCCL/gloo all-gather bus bandwidth), `step_us` (the device's gap per
    ring step: the signal and its wait), `h2d_gbps` and `d2h_gbps` (copies
    between pinned host memory and the device); the GEMM's slowdown beside
    copy-engine traffic and beside a collective's kernels; and the host
    time of one call and of one ring step per runner, in ms (`host_ms`:
    runner -> (per call, per step); per call: what an eager call adds to
    the device's time, the host's work no device work hides). `copy_source` says how `copy_gbps` was
    had: "peer" (a push to a peer GPU), "estimate" (no peer visible: a
    same-device copy scaled by NVLINK_PER_HBM) or "none"."""

    device: str
    gemm_tflops: float
    copy_gbps: float
    collective_gbps: float
    step_us: float
    h2d_gbps: float = 10.0
    d2h_gbps: float = 10.0
    gemm_slowdown_copy: float = 1.0
    gemm_slowdown_collective: float = 1.0
    host_ms: tuple = ()  # ((runner, per call, per step), ...)
    copy_source: str = "none"

    def transfer_ms(self, nbytes: float, direction: str = "H2D") -> float:
        gbps = self.h2d_gbps if direction == "H2D" else self.d2h_gbps
        return nbytes / (gbps * 1e9) * 1e3

    def gemm_ms(self, flops: float) -> float:
        return flops / (self.gemm_tflops * 1e12) * 1e3

    def move_ms(self, nbytes: float, p2p: bool) -> float:
        gbps = self.copy_gbps if p2p and self.copy_gbps > 0 else self.collective_gbps
        return nbytes / (gbps * 1e9) * 1e3

    def local_ms(self, nbytes: float) -> float:
        """A reduction that reads and writes `nbytes` in all in device
        memory, at a same-device copy's rate of bytes copied (a copy moves
        twice as many): the reduce ring's sum over two slots of 128 MiB
        into a third took 0.27 ms on H100, where this gives 0.31."""
        gbps = self.copy_gbps / NVLINK_PER_HBM if self.copy_gbps > 0 else self.collective_gbps
        return nbytes / (gbps * 1e9) * 1e3

    def host(self, runner: str) -> tuple[float, float]:
        """(ms per call, ms per ring step) on the host for `runner`
        ("python", "cpp" or "replay"); nothing where the model has no
        figure (the CPU model: its host time is its compute)."""
        for name, call, step in self.host_ms:
            if name == runner:
                return call, step
        return 0.0, 0.0

    def to_words(self) -> list[int]:
        """The numbers of the model as int64 words (each float's bits), to
        agree on across ranks; `from_words` reads them back."""
        numbers = [getattr(self, f) for f in _NUMBER_FIELDS]
        numbers += [v for _, call, step in _host_rows(self) for v in (call, step)]
        return [struct.unpack("<q", struct.pack("<d", float(v)))[0] for v in numbers]

    def from_words(self, words: list[int]) -> MachineModel:
        """This model with the numbers of `words` (another rank's `to_words`)."""
        values = [struct.unpack("<d", struct.pack("<q", int(w)))[0] for w in words]
        fields = dict(zip(_NUMBER_FIELDS, values))
        rest = values[len(_NUMBER_FIELDS):]
        rows = tuple((name, rest[2 * i], rest[2 * i + 1]) for i, name in enumerate(RUNNERS))
        return dataclasses.replace(self, **fields, host_ms=rows)


RUNNERS = ("python", "cpp", "replay")
_NUMBER_FIELDS = (
    "gemm_tflops", "copy_gbps", "collective_gbps", "step_us", "h2d_gbps", "d2h_gbps",
    "gemm_slowdown_copy", "gemm_slowdown_collective",
)


def _host_rows(model: MachineModel) -> list[tuple[str, float, float]]:
    return [(r, *model.host(r)) for r in RUNNERS]


# What a multi-device call and one ring step cost on the host, per runner,
# in ms, measured on the 2×H100 hosts (2026-11-27, the AG+matmul ring):
# the Python evaluator's ring call fits 0.6 + 0.4·S ms (S steps, each about
# 15 interpreted ops); a CUDA-graph replay 0.04–0.06 ms. The C++
# executor's eager call took 0.11–0.22 ms longer than its replay, the
# copy-engine ring of one chunk per peer at total M = 2048…32768 and the
# sequential program alike (0.2), though its whole call keeps the host
# 0.33–0.45 ms: the rest overlaps the GEMMs it launched first. A ring step
# costs it 0.085 ms (its NCCL ring at one step against its sequential call).
HOST_MS = (("python", 0.6, 0.4), ("cpp", 0.2, 0.085), ("replay", 0.05, 0.0))
# The GEMM's slowdown beside copy-engine pushes and beside NCCL's kernels,
# which take SMs from it (2×H200, the hand-written rings' micro rows).
GEMM_SLOWDOWN_COPY = 1.04
GEMM_SLOWDOWN_COLLECTIVE = 1.12
# A push to an NVLink peer against a same-device copy's throughput (356–373
# against 1210–1360 GB/s on H100 and H200): the estimate where no peer GPU
# is visible to time a push.
NVLINK_PER_HBM = 0.27
# The device's gap per ring step (a signal and its wait), measured in
# replays of the hand-written ring: 5–15 µs.
STEP_US = 10.0


# CPU ranks over gloo: nothing overlaps on one core, and the ring's extra
# steps cost host time; the model still decides by the same arithmetic.
CPU_MODEL = MachineModel(
    "cpu", gemm_tflops=0.05, copy_gbps=0.0, collective_gbps=2.0, step_us=200.0, h2d_gbps=5.0, d2h_gbps=5.0
)


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HOSTIR_CACHE_DIR", pathlib.Path.home() / ".cache" / "hostir"))


def _model_path(device_name: str) -> pathlib.Path:
    # v3: timed on the device only, a push to a peer, host costs; per torch,
    # CUDA and the GPUs this process sees.
    key = f"{device_name}_torch{torch.__version__}_cuda{torch.version.cuda}_gpus{torch.cuda.device_count()}"
    safe = "".join(ch if ch.isalnum() else "_" for ch in key)
    return cache_dir() / f"machine_{safe}.v3.json"


def load_model(device_name: str) -> MachineModel | None:
    path = _model_path(device_name)
    try:
        data = json.loads(path.read_text())
        data["host_ms"] = tuple(tuple(row) for row in data.get("host_ms", ()))
        return MachineModel(**data)
    except (OSError, ValueError, TypeError):
        return None


def save_model(model: MachineModel, replace: bool = False) -> pathlib.Path:
    """Write `model` unless the cache already holds one for its device: the
    first writer wins (written aside, then linked into place), so ranks of
    one node that measured at once all read back the same model.
    `replace=True` writes over it (a re-measurement)."""
    path = _model_path(model.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_suffix(f".{os.getpid()}.tmp")
    aside.write_text(json.dumps(dataclasses.asdict(model), indent=1))
    try:
        if replace:
            os.replace(aside, path)
        else:
            os.link(aside, path)
    except FileExistsError:
        pass
    finally:
        aside.unlink(missing_ok=True)
    return path


def machine_model(device) -> MachineModel:
    """This machine's model: measured once per device name and cached."""
    if getattr(device, "type", "cpu") != "cuda":
        return CPU_MODEL
    name = torch.cuda.get_device_name(device)
    model = load_model(name)
    if model is None:
        model = measure(device)
        try:
            save_model(model)
        except OSError:
            return model
        model = load_model(name) or model
    return model


def _device_ms(fn, device, iters: int = 20, trials: int = 5) -> float:
    """The median over `trials` of `fn`'s device time per call: the launches
    queue behind a spinning kernel first, so no host gap between them
    counts. A trial whose launches took the host longer than half the
    spin (a busy host: the first call's other threads hold the GIL) is
    timed again behind a spin four times as long."""
    import time

    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    times = []
    cycles = _SPIN_CYCLES
    while len(times) < trials:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        queued = time.perf_counter()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        host_ms = (time.perf_counter() - queued) * 1e3
        torch.cuda.synchronize(device)
        if host_ms > _SPIN_MS_AT_LEAST * cycles / _SPIN_CYCLES / 2 and cycles < _SPIN_CYCLES << 8:
            cycles *= 4
            continue
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


# The spin ahead of a timed trial: 20M cycles, at least 8 ms on GPUs of
# up to 2.5 GHz.
_SPIN_CYCLES = 20_000_000
_SPIN_MS_AT_LEAST = 8.0


def _peer_of(index: int) -> int | None:
    for peer in range(torch.cuda.device_count()):
        if peer != index and torch.cuda.can_device_access_peer(index, peer):
            return peer
    return None


def measure(device) -> MachineModel:
    """Time this GPU on the device only: a bf16 GEMM, a copy-engine push of
    64 MiB to a peer GPU where one is visible (else a same-device copy
    scaled by NVLINK_PER_HBM), and pinned host copies. The host costs, the
    GEMM's slowdowns and the collective bandwidth are this module's
    measured constants."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        m, k, n = 8192, 8192, 4096
        # A generator of its own: the caller's random stream stays as it
        # was (only the rank that measures would have drawn from it, and
        # ranks seeded alike would then draw different numbers).
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16, generator=gen)
        gemm_ms = _device_ms(lambda: torch.matmul(a, b), device)
        src = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        peer = _peer_of(index)
        if peer is not None:
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=torch.device("cuda", peer))
            copy_gbps = src.numel() / (_device_ms(lambda: dst.copy_(src), device, iters=10) * 1e-3) / 1e9
            source = "peer"
        else:
            dst = torch.empty_like(src)
            local = src.numel() / (_device_ms(lambda: dst.copy_(src), device, iters=10) * 1e-3) / 1e9
            copy_gbps, source = local * NVLINK_PER_HBM, "estimate"
        local_dst = torch.empty_like(src)
        pinned = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        h2d_ms = _device_ms(lambda: local_dst.copy_(pinned, non_blocking=True), device, iters=5, trials=3)
        d2h_ms = _device_ms(lambda: pinned.copy_(local_dst, non_blocking=True), device, iters=5, trials=3)
        name = torch.cuda.get_device_name(device)
    return MachineModel(
        name,
        gemm_tflops=2 * m * k * n / (gemm_ms * 1e-3) / 1e12,
        copy_gbps=copy_gbps,
        collective_gbps=150.0,
        step_us=STEP_US,
        h2d_gbps=src.numel() / (h2d_ms * 1e-3) / 1e9,
        d2h_gbps=src.numel() / (d2h_ms * 1e-3) / 1e9,
        gemm_slowdown_copy=GEMM_SLOWDOWN_COPY,
        gemm_slowdown_collective=GEMM_SLOWDOWN_COLLECTIVE,
        host_ms=HOST_MS,
        copy_source=source,
    )


def agree(comm) -> MachineModel:
    """Every rank of `comm` takes rank 0's model of its GPU (numbers only):
    ranks on other nodes, or that measured apart, then plan the same
    programs. Collective: called once, when a communicator on GPUs is made
    (every rank is at the same point then). Only rank 0 measures (where
    its cache has no model); the others wait for its numbers at the
    exchange instead of measuring what they would throw away, and no
    rank's pushes or GEMMs run beside the ones rank 0 times."""
    if comm.world_size > 1 and comm.rank != 0:
        model = _placeholder(comm.device)
    else:
        model = machine_model(comm.device)
    if comm.world_size > 1:
        everyone = comm.all_gather_words(torch.tensor(model.to_words(), dtype=torch.int64)).tolist()
        model = model.from_words(everyone[0])
    comm._machine_model = model
    return model


def _placeholder(device) -> MachineModel:
    """What a rank other than 0 offers at the exchange (it takes rank 0's):
    a model of the right length, measured nowhere."""
    name = torch.cuda.get_device_name(device) if getattr(device, "type", "cpu") == "cuda" else "cpu"
    return MachineModel(name, gemm_tflops=0.0, copy_gbps=0.0, collective_gbps=0.0, step_us=0.0, host_ms=HOST_MS)


def _agree_on_creation(comm) -> None:
    if comm.device.type == "cuda":
        agree(comm)


communicator.on_creation(_agree_on_creation)


# ---------------------------------------------------------------- a call's time


def predict_ms(model: MachineModel, D: int, rows: int, k: int, n: int, itemsize: int, kind: str,
               chunks: int = 1, transport: str = "NCCL", runner: str = "cpp", replay: bool = False,
               reduce: bool = False, fusable: bool = True) -> float:
    """The predicted time of one call, in ms. Replayed: the device's time
    (or the replay's launch, if longer). Eager: the runner's host time per
    call that no device work hides, then the device's time, or the host's
    where it issues the ring's steps and the last GEMM more slowly than the
    device runs them. `kind`: "sequential" or "ring" with `chunks` per peer
    on `transport`; `reduce`: the reduce side, whose ring sums its D slots
    of rows x k partials after the last arrival unless it adds the peer's
    partial in the local GEMM (`fuses_reduction`, where the program is
    `fusable`)."""
    gemm = model.gemm_ms(2.0 * rows * k * n)  # one shard's GEMM
    if kind == "sequential":
        device = (D - 1) * model.move_ms(rows * k * itemsize, False) + D * gemm
        steps = 0
        last = gemm
    else:
        declared = backends.get(transport)
        copy_engine = declared.bandwidth == "copy"
        slowdown = model.gemm_slowdown_copy if declared.capabilities.uses_no_sms else model.gemm_slowdown_collective
        piece = gemm / chunks * slowdown
        move = model.move_ms(rows * k * itemsize / chunks, copy_engine)
        steps = chunks * (D - 1)
        # The local GEMM hides the first transfer, each later GEMM the next.
        device = gemm * slowdown + steps * max(piece, move) + steps * model.step_us * 1e-3
        last = piece
        if reduce and not (fusable and fuses_reduction(D, chunks)):
            summed = model.local_ms((D + 1) * rows * k * itemsize)
            device += summed
            last += summed
    call, step = model.host("replay" if replay else runner)
    if replay:
        return max(device, call)
    # The host issues every step before the last GEMM can start.
    return call + max(device, steps * step + last)


# ---------------------------------------------------------------- hoisting transfers

# The pieces a chunked transfer cuts a linear's weight into, and the cost of
# each extra piece. On one H100 (torch 2.11), 6 layers of 8192^2 bf16 weights
# hoisted and moved in 4 pieces ran faster than moved whole at every M from 1
# to 16384 (15.07 against 15.20 ms at M = 1, 15.68 against 16.65 at 8192),
# so a piece costs nothing here and pieces win ties.
CHUNKS = 4
PIECE_US = 0.0
# The gap each hoisted post leaves on the copy engine beyond its copy (the
# cross-stream waits and the budget's wait for a freed buffer). With the budget
# of two layers' weights the same stack ran 0.13-0.16 ms per layer slower
# hoisted than sequential where the compute is negligible (M = 1: 16.79
# against 15.84 ms; M = 512: 16.66 against 15.91; one H100, one run), so
# that hoisting loses where it hides no compute.
HANDOFF_US = 160.0
# A whole post that the C++ executor makes leaves no such gap (those runs
# posted from the Python evaluator). On the same H100 (one run, 11 rounds) the
# stack hoisted whole and posted from C++ ran as fast as or faster than the
# sequential program at every M measured: M = 1: 15.04 ms against 15.31
# (hostir's sequential program; 15.09 hand-written), M = 512: 14.92 against
# 15.52, M = 1024: 15.00 against 15.97, M = 2048: 15.23 against 17.07. Weights
# moved in pieces are chunk views, which run on the Python evaluator, so
# pieces still pay HANDOFF_US.
CPP_HANDOFF_US = 0.0
# The least gain, as a fraction of the sequential estimate, that hoisting
# must promise to run: the model's figures are measured once and times move
# by a few percent from run to run, so where hoisting wins by less than
# that the sequential program runs (it is never slower than itself). Not
# asked of whole posts from the C++ executor on the GPU, which were measured
# never slower than the sequential program (CPP_HANDOFF_US) and beat it
# where the sequential program's own start costs more than the little
# compute hoisting hides.
NOISE = 0.03


def pipeline_ms(transfers: list[float], computes: list[float], pieces: int = 1, depth: int = 2,
                step_ms: float = 0.0, handoff_ms: float = 0.0) -> float:
    """The time of a program whose posts take `transfers` ms each, in order
    on one copy engine, and whose compute that reads post i takes
    `computes[i]` ms, when each post moves as `pieces` pieces and the
    compute of piece j waits for that piece only, and the post of layer l
    starts once layer l - depth has computed (its buffer is free): depth 1
    is the sequential program, 2 double buffering. `step_ms` is the fixed
    cost of each extra piece, `handoff_ms` the gap a hoisted post leaves on
    the copy engine (measured, not explained: see HANDOFF_US)."""
    copy_free = compute_free = 0.0
    done: list[float] = []
    for layer, (t, c) in enumerate(zip(transfers, computes)):
        allowed = done[layer - depth] if layer >= depth else 0.0
        ready = []
        copy_free = max(copy_free, allowed) + handoff_ms
        for _ in range(pieces):
            copy_free = max(copy_free, allowed) + t / pieces
            ready.append(copy_free)
        for j in range(pieces):
            compute_free = max(compute_free, ready[j]) + c / pieces + (step_ms if j else 0.0)
        done.append(compute_free)
    return compute_free


def choose_hoisting(
    model: MachineModel, transfers: list[float], computes: list[float], pieces: bool = True, cpp_posts: bool = False
) -> tuple[str, int, str]:
    """("hoist" or "sequential", chunks, why) for a program whose posts take
    `transfers` ms each and whose compute reading post i takes `computes[i]`
    ms (`pipeline_ms`): the fastest of the sequential program, the posts
    hoisted one layer ahead (double buffering), and hoisted in CHUNKS
    pieces (PIECE_US per extra piece; only with `pieces`: on the CPU a
    transfer is a copy that overlaps nothing, and pieces would only change
    the order of the sums); pieces first on a tie. On the GPU a hoisted
    post also pays HANDOFF_US, so where the compute it would hide is
    shorter than that (a few rows), the sequential program runs. So does
    it where the fastest hoisted estimate beats it by less than NOISE of
    its own: a gain within the model's noise is no gain to bet on.

    `cpp_posts`: the C++ executor runs the program, so whole posts pay
    CPP_HANDOFF_US instead and are taken for any gain (see NOISE)."""
    if not transfers:
        return "hoist", 1, "nothing to move"
    sequential = pipeline_ms(transfers, computes, depth=1)
    handoff = HANDOFF_US * 1e-3 if pieces else 0.0
    whole_from_cpp = pieces and cpp_posts
    whole_handoff = CPP_HANDOFF_US * 1e-3 if whole_from_cpp else handoff
    hoisted = pipeline_ms(transfers, computes, handoff_ms=whole_handoff)
    chunked = pipeline_ms(transfers, computes, CHUNKS, step_ms=PIECE_US * 1e-3, handoff_ms=handoff)
    numbers = f"sequential {sequential:.3f} ms, hoisted {hoisted:.3f} ms, in {CHUNKS} chunks {chunked:.3f} ms"
    candidates = [("hoist", 1, hoisted), ("sequential", 1, sequential)]
    if pieces:
        candidates.insert(0, ("hoist", CHUNKS, chunked))
    # min() keeps the first of equal estimates: pieces, then whole posts.
    best = min(candidates, key=lambda c: c[2])
    margin = 0.0 if whole_from_cpp and best[:2] == ("hoist", 1) else NOISE
    if best[0] == "hoist" and best[2] > sequential * (1.0 - margin):
        return "sequential", 1, f"model ({model.device}): {numbers}; hoisting gains less than {NOISE:.0%}"
    return best[0], best[1], f"model ({model.device}): {numbers}"


def posts_and_computes(
    fusion, inputs, host: frozenset, model: MachineModel, world_size: int | None
) -> tuple[list, list] | None:
    """Per post (a host input's transfer, or a sharded input's Allgather, in
    the order ops first read them) its time, and the compute time of the
    ops from that one to the next, from the inputs' shapes (a linear or
    matmul costs 2·M·N·K, M the rows of the largest input that stays), on
    `world_size` ranks (None: one device); None when the fusion has
    neither."""
    moved, whole = {}, {}
    for i, (tv, t) in enumerate(zip(fusion.inputs, inputs)):
        if not isinstance(tv, ir.TensorView) or not isinstance(t, torch.Tensor):
            continue
        nbytes = ir.nbytes(t)
        if ir.in_host_memory(tv) or i in host:
            moved[tv], whole[tv] = model.transfer_ms(nbytes), t.numel()
        elif world_size is not None and tv.device_axes():
            moved[tv] = model.move_ms(nbytes * (world_size - 1), False)
            whole[tv] = t.numel() * world_size
    if not moved:
        return None
    for tv, t in zip(fusion.inputs, inputs):
        if isinstance(tv, ir.TensorView) and isinstance(t, torch.Tensor) and tv not in whole:
            whole[tv] = t.numel()
    stays = [t for tv, t in zip(fusion.inputs, inputs) if isinstance(t, torch.Tensor) and tv not in moved and t.dim()]
    rows = max((max(1, t.numel() // max(1, t.shape[-1])) for t in stays), default=1)
    origin = {tv: tv for tv in whole}
    transfers: list[float] = []
    computes: list[float] = []
    for e in fusion.exprs:
        if isinstance(e, ir.Set) and e.input in origin:
            origin[e.out] = origin[e.input]
            continue
        read = [origin[v] for v in e.inputs() if v in origin]
        for tv in read:
            if tv in moved:
                transfers.append(moved.pop(tv))
                computes.append(0.0)
        second = getattr(e, "weight", None) or getattr(e, "b", None)
        if computes and isinstance(e, (ir.LinearOp, ir.MatmulOp)) and second in origin:
            computes[-1] += 2.0 * rows * whole[origin[second]] / (model.gemm_tflops * 1e12) * 1e3
    return transfers, computes
