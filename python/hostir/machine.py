"""The choice of a `Schedule` per input signature, from a model of this
machine.

`choose` picks a schedule for a fusion's inputs from a `MachineModel` (GEMM
and copy throughput of this machine, measured once and cached per machine
under `~/.cache/hostir/`, the first rank to measure writing it for all, or
the CPU defaults): the sequential program where overlap cannot pay (the
time a ring could hide is smaller than what it costs), else the ring with
the transport the probe allows and the chunk count the model prefers.
`HOSTIR_SCHEDULE` (or `ExecutorParams.schedule`) forces a choice (its text
form: `hostir.lower.schedule`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from hostir.lower.decompose_device_axis import walks_device_axis
from hostir.lower.schedule import Schedule, parse
from hostir.runtime.transports import cuda

# ---------------------------------------------------------------- the machine


@dataclasses.dataclass(frozen=True)
class MachineModel:
    """Measured throughputs: `gemm_tflops` (bf16 GEMM), `copy_gbps` (one-way
    peer copy with the copy engine; 0 without P2P), `collective_gbps`
    (NCCL/gloo all-gather bus bandwidth), `step_us` (fixed cost of one ring
    step: host issue, signal and launch)."""

    device: str
    gemm_tflops: float
    copy_gbps: float
    collective_gbps: float
    step_us: float

    def gemm_ms(self, flops: float) -> float:
        return flops / (self.gemm_tflops * 1e12) * 1e3

    def move_ms(self, nbytes: float, p2p: bool) -> float:
        gbps = self.copy_gbps if p2p and self.copy_gbps > 0 else self.collective_gbps
        return nbytes / (gbps * 1e9) * 1e3


# CPU ranks over gloo: nothing overlaps on one core, and the ring's extra
# steps cost host time; the model still decides by the same arithmetic.
CPU_MODEL = MachineModel("cpu", gemm_tflops=0.05, copy_gbps=0.0, collective_gbps=2.0, step_us=200.0)


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HOSTIR_CACHE_DIR", pathlib.Path.home() / ".cache" / "hostir"))


def _model_path(device_name: str) -> pathlib.Path:
    safe = "".join(ch if ch.isalnum() else "_" for ch in device_name)
    return cache_dir() / f"machine_{safe}.json"


def load_model(device_name: str) -> MachineModel | None:
    path = _model_path(device_name)
    try:
        data = json.loads(path.read_text())
        return MachineModel(**data)
    except (OSError, ValueError, TypeError):
        return None


def save_model(model: MachineModel) -> pathlib.Path:
    """Write `model` unless the cache already holds one for its device: the
    first writer wins (written aside, then linked into place), so ranks of
    one node that measured at once all read back the same model."""
    path = _model_path(model.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_suffix(f".{os.getpid()}.tmp")
    aside.write_text(json.dumps(dataclasses.asdict(model), indent=1))
    try:
        os.link(aside, path)
    except FileExistsError:
        pass
    finally:
        aside.unlink(missing_ok=True)
    return path


def machine_model(device) -> MachineModel:
    """This machine's model: measured once per device name and cached."""
    import torch

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


def measure(device) -> MachineModel:
    """GEMM throughput and local copy-engine throughput of `device` (a
    same-device copy stands in for a peer copy; NVLink peers are faster)."""
    import torch

    def timed(fn, iters=10):
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters

    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    gemm_ms = timed(lambda: torch.matmul(a, b))
    src = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src))
    name = torch.cuda.get_device_name(device)
    return MachineModel(
        name,
        gemm_tflops=2 * n**3 / (gemm_ms * 1e-3) / 1e12,
        copy_gbps=src.numel() / (copy_ms * 1e-3) / 1e9,
        collective_gbps=150.0,
        step_us=30.0,
    )


# ---------------------------------------------------------------- the choice


def choose(model: MachineModel, D: int, rows: int, k: int, n: int, itemsize: int, p2p: str | None,
           backend: str) -> Schedule:
    """The schedule for a gather or reduce side of `rows` x `k` shards per
    rank (times an n-wide weight), on D ranks. `p2p` is None when the cuda
    transport can run, else why not."""
    transport = "cuda" if p2p is None else backend
    why = "" if p2p is None else f"no P2P: {p2p}"
    gemm = model.gemm_ms(2.0 * rows * k * n)  # one shard's GEMM
    move = model.move_ms(rows * k * itemsize, p2p is None)  # one shard's transfer
    steps = (D - 1)
    # Sequential: the whole transfer then every GEMM. Ring: the local GEMM
    # hides the first transfer, each later GEMM hides the next.
    sequential = steps * move + D * gemm
    ring = gemm + steps * max(gemm, move) + steps * model.step_us * 1e-3
    if ring >= sequential:
        note = f"a ring would take {ring:.3f} ms against {sequential:.3f} ms sequentially"
        return Schedule("sequential", note=note)
    # More chunks pay only while a step is much longer than its fixed cost.
    chunks = 1
    while chunks < 4 and rows % (chunks * 2) == 0 and max(gemm, move) / (chunks * 2) > 20 * model.step_us * 1e-3:
        chunks *= 2
    note = f"model: ring {ring:.3f} ms, sequential {sequential:.3f} ms" + (f", {why}" if why else "")
    return Schedule("ring", chunks=chunks, transport=transport, note=note)


# ---------------------------------------------------------------- per input signature


def decomposable(fusion) -> bool:
    """Whether `fusion` may hold a device axis walked as a stream axis."""
    # Other programs keep one lowering for every shape: their key holds no
    # schedule. Asked at every execute: the answer is kept per version.
    cached = getattr(fusion, "_walks_device_axis", None)
    if cached is None or cached[0] != fusion.version:
        cached = (fusion.version, walks_device_axis(fusion.exprs))
        fusion._walks_device_axis = cached
    return cached[1]


def model_for(comm) -> MachineModel:
    """The machine model of `comm`'s device, read once per communicator.
    No collective: the choice is made while ranks may still be out of step
    (one failing its input checks); ranks of one node share the cached
    model, and ranks that choose differently fail the agreement on the
    program with a clear error."""
    model = getattr(comm, "_machine_model", None)
    if model is None:
        model = comm._machine_model = machine_model(comm.device)
    return model


def p2p_reason(comm) -> str | None:
    """None when the cuda transport can run on every rank, else why not."""
    if comm.device.type != "cuda":
        return f"the ranks run on {comm.device.type}"
    return cuda.probe(comm)


def _shape_hint(fusion, inputs, D: int) -> tuple[int, int, int, int]:
    """(rows, k, n, itemsize) of one shard's GEMM, from the sharded input
    with the most elements (rows x k per peer) and the other inputs'
    last axis (n)."""
    sharded = [(t, tv) for tv, t in zip(fusion.inputs, inputs) if tv.device_axes()]
    t, tv = max(sharded, key=lambda p: p[0].numel())
    k = t.shape[-1] if t.dim() else 1
    rows = max(1, t.numel() // max(k, 1))
    if t.dim() > 2 and t.shape[0] == D and not tv.axis(0).is_device_parallel:
        rows //= D
    others = [x.shape[-1] for x, v in zip(inputs, fusion.inputs) if v is not tv and x.dim() >= 2]
    n = max(others) if others else k
    return rows, k, n, t.element_size()


def for_inputs(fusion, inputs, comm, forced=None) -> Schedule | None:
    """The schedule of `fusion` on these inputs: `forced` (a Schedule or its
    text; else `HOSTIR_SCHEDULE`) or the model's choice. None where the
    fusion has nothing to decompose. Every rank gets the same answer for
    the same input shapes."""
    if comm is None or not decomposable(fusion):
        return None
    if forced is None:
        forced = os.environ.get("HOSTIR_SCHEDULE") or None
    if forced is not None:
        schedule = parse(forced) if isinstance(forced, str) else forced
        if schedule.transport == "cuda":
            reason = p2p_reason(comm)
            if reason is not None:
                schedule = dataclasses.replace(schedule, transport=None, note=f"cuda transport unavailable: {reason}")
        return schedule
    D = comm.world_size
    rows, k, n, itemsize = _shape_hint(fusion, inputs, D)
    backend = "NCCL" if comm.backend == "nccl" else "gloo"
    return choose(model_for(comm), D, rows, k, n, itemsize, p2p_reason(comm), backend)
