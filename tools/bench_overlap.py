"""All-gather + matmul overlap on several GPUs: hostir against eager baselines.

Every rank holds a shard ``x`` of ``M`` rows and ``K`` columns and the same
weight ``w`` of ``K`` x ``N``; the program all-gathers the shards into the
``D*M`` x ``K`` matrix (``D`` = world size) and multiplies it by ``w``, so every
rank ends with the whole ``D*M`` x ``N`` product (bf16, NCCL). Variants, all in
one run on the same tensors:

* ``gemm_alone``: ``x_full @ w`` on an already gathered ``x_full``; the lower
  bound of any overlap.
* ``allgather_alone``: ``dist.all_gather_into_tensor`` of the shard.
* ``sequential``: the all-gather, then the matmul (eager torch, one stream).
* ``nccl_pipeline_S`` (S = 2, 4): by hand, the shard cut into S row chunks;
  chunk i is all-gathered and multiplied on worker stream i, so the matmul of
  one chunk can run while the next chunk is gathered.
* ``hostir_S`` (S = 1, 2, 4, 8): the same program written with hostir: the
  input ``[S, D, M/S, K]`` sharded on axis 1 (``mesh_x``), a ``set`` that lowers
  to an Allgather per chunk and a ``matmul``, both with axis 0 on
  ``ParallelType.stream`` (S = 1: no stream axis, one all-gather and one
  matmul), run with a preallocated output and ``number_of_streams=S``, on the
  Python evaluator; ``hostir_cpp_S`` runs it on the C++ executor and
  ``hostir_cuda_graph_S`` replays a CUDA graph of the C++ executor's run
  (NCCL collectives inside the graph).
* ``symm_mem``: ``torch.ops.symm_mem.fused_all_gather_matmul`` (PyTorch's
  symmetric-memory op, which pulls peer shards with the copy engine), where
  this torch has it; a failure is recorded, not fatal.
* ``hostir_<decomposition>`` and ``..._replay``: the canonical overlapped
  program (``hostir.overlap.allgather_matmul``: the device axis walked as the
  stream axis) under each forced schedule — ring over NCCL P2P, ring over the
  copy-engine ``cuda`` transport (1 and 2 chunks per peer, both directions),
  collective (a broadcast per rank), sequential — and the machine model's own
  choice (``auto``); ``_replay`` is the same captured in CUDA graphs
  (``hostir.runtime.graphs.capture``) and replayed.

``--problem rs`` measures matmul + reduce-scatter instead (``--m`` is then the
total rows M, ``--k`` the K of each rank, output ``[M/D, N]`` per rank):
``gemm_alone`` (the local partial), ``reduce_scatter_alone``, ``sequential``
(matmul, then ``reduce_scatter_tensor``), ``nccl_pipeline_S``, ``symm_mem``
(``fused_matmul_reduce_scatter``) and the same ``hostir_*`` variants on
``hostir.overlap.matmul_reduce_scatter``. ``--sweep M1,M2,...`` (total rows)
runs the AG+matmul baselines and hostir's auto and ring variants at each M and
writes ``bench_overlap_<tag>_sweep.{md,json}`` and, where matplotlib is
installed, a PNG plot of ms and speedup over sequential per variant.

How it is timed: before every iteration each rank synchronizes its GPU and
all ranks meet at a barrier, so they start together; CUDA events around the
whole call (host work included: hostir's evaluator runs in Python) give one
time per iteration and rank. After the warm-ups, ``--iters`` iterations are
timed; per iteration the slowest rank's time counts (the collective is done
only when every rank is), and the median of those is reported. Derived
columns: speedup over ``sequential``, ratio to ``gemm_alone``, and overlap
efficiency ``(T_ag + T_gemm - T) / min(T_ag, T_gemm)`` (0: nothing hidden,
1: the shorter of the two hidden entirely).

Every variant's result is checked against the sequential one before it is
timed (bf16 tolerances; inputs are normal, ``w`` scaled by 1/sqrt(K) so the
outputs are O(1)). hostir and the hand-written pipeline produce
``[S, D, M/S, N]``, whose element ``[s, d, j]`` is row ``s*(M/S) + j`` of rank
``d``'s shard times ``w``; the sequential ``[D*M, N]`` is compared through
``view(D, S, M/S, N).permute(1, 0, 2, 3)``.

Run on the GPU machine from the repository root (one process per GPU):

    torchrun --standalone --nproc-per-node 2 tools/bench_overlap.py --tag h200x2
    mpirun --allow-run-as-root -np 2 --bind-to none python3 tools/bench_overlap.py --tag h200x2

Under torchrun, spell the sizes ``--M``/``--K``/``--N``: torchrun's parser
takes ``--m`` and ``--n`` for abbreviations of its own options and stops.

Smoke test on the CPU (gloo, float32, ``time.perf_counter``; the NCCL pipeline
and symm_mem are skipped):

    mpirun -np 2 --oversubscribe python3 tools/bench_overlap.py --cpu \\
        --m 64 --k 32 --n 16 --iters 3 --warmup 1 --out-dir /tmp/bench

Rank 0 prints the table and writes ``bench_overlap_<tag>.md`` and ``.json``
under ``--out-dir`` (rewritten after every variant, so a run cut short still
leaves the variants it finished). After timing each hostir variant that
runs eagerly (not the ``_replay`` rows), one more traced iteration is saved
as ``timeline_<tag>_<variant>/`` (a Chrome / Perfetto trace per rank) and,
where matplotlib is installed, ``timeline_<tag>_<variant>.png``
(``--no-timeline`` skips it). ``--variants`` runs only the named rows of the
table (shell patterns: ``--variants 'sequential,hostir_ring*'``);
``--sweep-only`` runs the sweep without the table. hostir's rendezvous port is
``HOSTIR_MASTER_PORT`` (default: ``MASTER_PORT``, then 29500);
``HOSTIR_TIMEOUT`` bounds every collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import math
import os
import platform
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

# torch >= 2.13 deprecates all_gather_into_tensor (the baselines' call, as in
# torch 2.11's docs) with one warning per call site and rank.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)

try:
    import hostir
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))
    import hostir
import hostir.cpp
from hostir import DeviceMesh, FusionDefinition, ParallelType, overlap
from hostir import communicator as hostir_communicator
from hostir.runtime import graphs as hostir_graphs
from hostir.timeline import save_timeline

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks", "results")
HOSTIR_STREAMS = (1, 2, 4, 8)
PIPELINE_STREAMS = (2, 4)
# PERF.md's rule for numbers we keep; smaller values are allowed for smoke tests.
MIN_ITERS, MIN_WARMUP = 20, 5
# A teardown that has not finished after this long is abandoned: the results
# are written by then, and the probes saw NCCL teardown hang after symm_mem.
TEARDOWN_SECONDS = 30.0


# ---------------------------------------------------------------- setup


@dataclasses.dataclass
class Context:
    """What every variant shares: sizes, the tensors, and the control group."""

    cpu: bool
    rank: int
    world: int  # D
    m: int  # rows of a rank's shard
    k: int
    n: int
    dtype: torch.dtype
    device: torch.device
    x_full: torch.Tensor  # [D*M, K], every rank's shard, regenerated locally
    shard: torch.Tensor  # [M, K], this rank's rows of x_full (own storage)
    w: torch.Tensor  # [K, N]
    ctl: dist.ProcessGroup | None = None  # gloo group for barriers and metadata
    ref: torch.Tensor | None = None  # [D*M, N], the sequential result ([M/D, N] for rs)
    problem: str = "ag"
    # matmul + reduce-scatter: this rank's a [M, K] and b [K, N] (K its own
    # columns), hostir's views of them, and the local partial.
    rs_a_local: torch.Tensor | None = None
    rs_b_local: torch.Tensor | None = None
    rs_a: torch.Tensor | None = None
    rs_b: torch.Tensor | None = None
    rs_partial: torch.Tensor | None = None

    @property
    def tolerances(self) -> dict:
        # bf16 keeps 8 bits of mantissa: results that differ only in how the
        # GEMM was tiled or split may differ by a few units in the last place
        # (cuBLAS may also reduce split-K partials in bf16). float32 on the
        # CPU differs only by summation order.
        if self.dtype == torch.bfloat16:
            return {"rtol": 1.6e-2, "atol": 1e-2}
        return {"rtol": 1e-4, "atol": 1e-4}

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        # A CPU barrier on gloo, not dist.barrier() on the NCCL group: it
        # queues no kernel on the device being timed, and the probes saw an
        # NCCL barrier hang after symm_mem had been used.
        dist.barrier(group=self.ctl)

    def gather(self, obj) -> list:
        everyone = [None] * self.world
        dist.all_gather_object(everyone, obj, group=self.ctl)
        return everyone


def make_inputs(args, rank: int, world: int, device: torch.device, dtype: torch.dtype):
    """Every rank's shard is drawn from a generator seeded by that rank, so
    each rank can rebuild the whole gathered matrix without communication
    (an independent reference for the all-gathers); `w` is the same on all
    ranks."""

    def normal(shape, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    x_full = torch.cat([normal((args.m, args.k), 1000 + r) for r in range(world)]).to(dtype)
    w = (normal((args.k, args.n), 7) / math.sqrt(args.k)).to(dtype)
    shard = x_full[rank * args.m : (rank + 1) * args.m].clone()
    return x_full, shard, w


def build_hostir(ctx: Context, streams: int) -> FusionDefinition:
    """The AG+matmul program; `streams` = 1 leaves out the stream axes."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[streams, ctx.world, -1, ctx.k], dtype=ctx.dtype)
        w = fd.define_tensor(shape=[ctx.k, ctx.n], dtype=ctx.dtype)
        xg = fd.ops.set(x)  # replicated copy of a sharded tensor: an Allgather
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    mesh = DeviceMesh(range(ctx.world))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.axis(1).parallelize(ParallelType.mesh_x)
    if streams > 1:
        xg.axis(0).parallelize(ParallelType.stream)
        y.axis(0).parallelize(ParallelType.stream)
    return fd


def hostir_kwargs(ctx: Context, streams: int) -> dict:
    kwargs = {"number_of_streams": streams, "check_ranks": "first"}
    if ctx.cpu:
        # --cpu on a machine with CUDA: hostir would otherwise pick NCCL.
        kwargs["backend"] = "gloo"
    return kwargs


def nan_buffer(ctx: Context, *shape) -> torch.Tensor:
    # Output buffers start as NaN, so a variant that writes nothing cannot
    # pass its check on memory a previous variant left correct.
    return torch.full(shape, float("nan"), dtype=ctx.dtype, device=ctx.device)


def chunk_major(ctx: Context, ref: torch.Tensor, streams: int) -> torch.Tensor:
    """`ref` [D*M, N] in the [S, D, M/S, N] order of hostir and the pipeline."""
    return ref.view(ctx.world, streams, ctx.m // streams, ctx.n).permute(1, 0, 2, 3)


# ---------------------------------------------------------------- variants
#
# A variant's setup allocates what it needs and returns (call, expected):
# call() runs it once and returns its result; expected() gives the tensor
# the result must match (called after the reference exists).

Setup = Callable[[Context], tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]]


def setup_gemm_alone(ctx: Context):
    y = nan_buffer(ctx, ctx.world * ctx.m, ctx.n)
    return (lambda: torch.matmul(ctx.x_full, ctx.w, out=y)), (lambda: ctx.ref)


def setup_allgather_alone(ctx: Context):
    gathered = nan_buffer(ctx, ctx.world * ctx.m, ctx.k)

    def call():
        dist.all_gather_into_tensor(gathered, ctx.shard)
        return gathered

    # Compared with the locally rebuilt x_full: exact, it is a copy.
    return call, (lambda: ctx.x_full)


def make_sequential(ctx: Context):
    gathered = nan_buffer(ctx, ctx.world * ctx.m, ctx.k)
    y = nan_buffer(ctx, ctx.world * ctx.m, ctx.n)

    def call():
        dist.all_gather_into_tensor(gathered, ctx.shard)
        return torch.matmul(gathered, ctx.w, out=y)

    return call


def setup_sequential(ctx: Context):
    # The reference itself: checked against the GEMM on the locally rebuilt
    # x_full, which needs no communication.
    return make_sequential(ctx), (lambda: ctx.x_full @ ctx.w)


def setup_nccl_pipeline(streams: int) -> Setup:
    def setup(ctx: Context):
        rows = ctx.m // streams
        chunks = ctx.shard.view(streams, rows, ctx.k)
        gathered = [nan_buffer(ctx, ctx.world * rows, ctx.k) for _ in range(streams)]
        out = nan_buffer(ctx, streams, ctx.world, rows, ctx.n)
        workers = [torch.cuda.Stream(ctx.device) for _ in range(streams)]

        def call():
            caller = torch.cuda.current_stream(ctx.device)
            for i in range(streams):
                worker = workers[i % streams]
                # The worker must not start before what the caller queued
                # (the inputs' producers, the start event).
                worker.wait_stream(caller)
                with torch.cuda.stream(worker):
                    # all_gather_into_tensor makes `worker` wait for NCCL's
                    # stream, so the matmul below reads a complete chunk.
                    dist.all_gather_into_tensor(gathered[i], chunks[i])
                    torch.matmul(gathered[i], ctx.w, out=out[i].view(ctx.world * rows, ctx.n))
            # The call is done, for the end event and the caller's next work,
            # only when every worker is.
            for worker in workers:
                caller.wait_stream(worker)
            return out

        return call, (lambda: chunk_major(ctx, ctx.ref, streams))

    return setup


def setup_hostir(streams: int, evaluator: str = "python", cuda_graph: bool = False) -> Setup:
    def setup(ctx: Context):
        fd = build_hostir(ctx, streams)
        rows = ctx.m // streams
        x_local = ctx.shard.view(streams, 1, rows, ctx.k)  # this rank's piece of [S, D, M/S, K]
        out = nan_buffer(ctx, streams, ctx.world, rows, ctx.n)
        kwargs = {**hostir_kwargs(ctx, streams), "evaluator": evaluator, "cuda_graph": cuda_graph}

        def call():
            fd.execute([x_local, ctx.w], outputs=[out], **kwargs)
            return out

        # One traced iteration, drawn as a stream timeline (run_variant).
        call.timeline = lambda directory, png: save_timeline(  # type: ignore[attr-defined]
            fd, [x_local, ctx.w], directory, png, title=f"hostir, {streams} streams", outputs=[out], **kwargs
        )
        return call, (lambda: chunk_major(ctx, ctx.ref, streams))

    return setup


def setup_symm_mem(ctx: Context):
    import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem

    group_name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        # Needed by older torch; newer torch deprecates it as unneeded.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
    # The shard lives in symmetric memory, as the docs set it up, so peers
    # can read it directly.
    a_shard = symm_mem.empty((ctx.m, ctx.k), dtype=ctx.dtype, device=ctx.device)
    symm_mem.rendezvous(a_shard, group_name)
    a_shard.copy_(ctx.shard)
    # No barrier here: a rank whose setup failed would meet it with the
    # error-agreement gather instead. The op starts with a symmetric-memory
    # barrier of its own before any peer reads the shard.
    ctx.sync()
    op = torch.ops.symm_mem.fused_all_gather_matmul

    def call():
        _, (y,) = op(a_shard, [ctx.w], gather_dim=0, group_name=group_name)
        return y

    return call, (lambda: ctx.ref)


def symm_mem_available(op: str = "fused_all_gather_matmul") -> str | None:
    """None if torch has the fused op, else why not."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception as exc:
        return f"torch.distributed._symmetric_memory unavailable: {exc}"
    if not hasattr(torch.ops.symm_mem, op):
        return f"torch.ops.symm_mem.{op} does not exist in this torch"
    return None


# (variant suffix, forced schedule; None: the machine model's choice)
DECOMPOSITIONS = (
    ("ring_nccl", "ring"),
    ("ring_cuda", "ring:transport=cuda"),
    ("ring_cuda_c2", "ring:transport=cuda,chunks=2"),
    ("ring_cuda_reverse", "ring:transport=cuda,direction=-1"),
    ("collective", "collective"),
    ("sequential", "sequential"),
    ("auto", None),
)


def decomposition_kwargs(ctx: Context, sched: str | None) -> dict:
    # The decompositions are timed as users call them: with the default
    # protections (check_ranks="always": every call agrees with the peers).
    kwargs = hostir_kwargs(ctx, 2)
    del kwargs["check_ranks"]
    if sched is not None:
        kwargs["schedule"] = sched
    return kwargs


def schedule_note(fd) -> str:
    """The decomposition the lowered program follows (its loop head)."""
    for program in fd.executor._programs.values():
        for line in str(program.container).splitlines():
            if "schedule=(" in line:
                return line[line.index("schedule=(") :].strip()[:600]
            if "(ring," in line or "(collective," in line:
                return line.strip()[:600]
    return ""


def setup_decomposition(sched: str | None, replay: bool) -> Setup:
    def setup(ctx: Context):
        if ctx.problem == "rs":
            fd = overlap.matmul_reduce_scatter(ctx.world, ctx.dtype)
            inputs = [ctx.rs_a, ctx.rs_b]
            expected = lambda: ctx.ref.view(1, *ctx.ref.shape)  # noqa: E731
        else:
            fd = overlap.allgather_matmul(ctx.world, ctx.dtype)
            inputs = [ctx.shard.view(1, ctx.m, ctx.k), ctx.w]
            expected = lambda: ctx.ref.view(ctx.world, ctx.m, ctx.n)  # noqa: E731
        kwargs = decomposition_kwargs(ctx, sched)
        if replay:
            run = hostir_graphs.capture(fd, inputs, **kwargs)

            def call():
                return run()[0]

        else:
            out = [None]

            def call():
                out[0] = fd.execute(inputs, **kwargs)[0]
                return out[0]

        call.note = lambda: schedule_note(fd)  # type: ignore[attr-defined]
        if not replay:
            # One traced eager call, drawn as a stream timeline (run_variant).
            title = f"hostir {'matmul+RS' if ctx.problem == 'rs' else 'AG+matmul'}, {sched or 'auto'}"
            call.timeline = lambda directory, png: save_timeline(  # type: ignore[attr-defined]
                fd, inputs, directory, png, title=title, **kwargs
            )
        return call, expected

    return setup


# ---------------------------------------------------------------- matmul + reduce-scatter


def setup_rs_gemm_alone(ctx: Context):
    part = nan_buffer(ctx, ctx.m, ctx.n)
    return (lambda: torch.matmul(ctx.rs_a_local, ctx.rs_b_local, out=part)), (lambda: ctx.rs_partial)


def setup_rs_alone(ctx: Context):
    out = nan_buffer(ctx, ctx.m // ctx.world, ctx.n)

    def call():
        dist.reduce_scatter_tensor(out, ctx.rs_partial)
        return out

    return call, (lambda: ctx.ref)


def make_rs_sequential(ctx: Context):
    part = nan_buffer(ctx, ctx.m, ctx.n)
    out = nan_buffer(ctx, ctx.m // ctx.world, ctx.n)

    def call():
        torch.matmul(ctx.rs_a_local, ctx.rs_b_local, out=part)
        dist.reduce_scatter_tensor(out, part)
        return out

    return call


def setup_rs_sequential(ctx: Context):
    return make_rs_sequential(ctx), (lambda: ctx.ref)


def setup_rs_nccl_pipeline(streams: int) -> Setup:
    def setup(ctx: Context):
        D, rows = ctx.world, ctx.m // ctx.world // streams
        # Chunk i: rows i of every destination's block, so each chunk's
        # reduce-scatter delivers rows i of this rank's output.
        a_chunks = ctx.rs_a_local.view(D, streams, rows, -1)
        parts = [nan_buffer(ctx, D, rows, ctx.n) for _ in range(streams)]
        out = nan_buffer(ctx, streams, rows, ctx.n)
        workers = [torch.cuda.Stream(ctx.device) for _ in range(streams)]

        def call():
            caller = torch.cuda.current_stream(ctx.device)
            for i in range(streams):
                workers[i].wait_stream(caller)
                with torch.cuda.stream(workers[i]):
                    torch.matmul(a_chunks[:, i], ctx.rs_b_local, out=parts[i])
                    dist.reduce_scatter_tensor(out[i], parts[i].view(D * rows, ctx.n))
            for worker in workers:
                caller.wait_stream(worker)
            return out.view(streams * rows, ctx.n)

        return call, (lambda: ctx.ref)

    return setup


def setup_rs_symm_mem(ctx: Context):
    import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)

    group_name = dist.group.WORLD.group_name
    op = torch.ops.symm_mem.fused_matmul_reduce_scatter

    def call():
        return op(ctx.rs_a_local, ctx.rs_b_local, "sum", scatter_dim=0, group_name=group_name)

    return call, (lambda: ctx.ref)


def rs_variants(ctx: Context) -> list[Variant]:
    out = [
        Variant("gemm_alone", setup_rs_gemm_alone),
        Variant("reduce_scatter_alone", setup_rs_alone),
        Variant("sequential", setup_rs_sequential),
    ]
    for s in PIPELINE_STREAMS:
        skip = "--cpu: CUDA streams and NCCL only" if ctx.cpu else None
        if skip is None and (ctx.m // ctx.world) % s:
            skip = f"M/D={ctx.m // ctx.world} not divisible by S={s}"
        out.append(Variant(f"nccl_pipeline_{s}", setup_rs_nccl_pipeline(s), skip))
    out += decomposition_variants(ctx)
    skip = "--cpu: needs CUDA" if ctx.cpu else symm_mem_available("fused_matmul_reduce_scatter")
    out.append(Variant("symm_mem", setup_rs_symm_mem, skip, optional=True))
    return out


def decomposition_variants(ctx: Context, names=None) -> list[Variant]:
    out = []
    for name, sched in DECOMPOSITIONS:
        if names is not None and name not in names:
            continue
        out.append(Variant(f"hostir_{name}", setup_decomposition(sched, replay=False)))
        skip = "--cpu: CUDA graphs need CUDA" if ctx.cpu else None
        out.append(Variant(f"hostir_{name}_replay", setup_decomposition(sched, replay=True), skip))
    return out


@dataclasses.dataclass
class Variant:
    name: str
    setup: Setup
    skip: str | None = None  # why it does not run, if it does not
    optional: bool = False  # a failure here does not fail the run


def variants(ctx: Context, names=None) -> list[Variant]:
    """In table order. hostir_1 runs first in fact (see main). `names`
    limits the hostir decompositions (the sweep runs a few)."""
    out = [
        Variant("gemm_alone", setup_gemm_alone),
        Variant("allgather_alone", setup_allgather_alone),
        Variant("sequential", setup_sequential),
    ]
    for s in PIPELINE_STREAMS:
        skip = "--cpu: CUDA streams and NCCL only" if ctx.cpu else None
        if skip is None and ctx.m % s:
            skip = f"M={ctx.m} not divisible by S={s}"
        out.append(Variant(f"nccl_pipeline_{s}", setup_nccl_pipeline(s), skip))
    for s in HOSTIR_STREAMS:
        skip = f"M={ctx.m} not divisible by S={s}" if ctx.m % s else None
        out.append(Variant(f"hostir_{s}", setup_hostir(s), skip))
        cpp_skip = skip or (None if hostir.cpp.available() else f"hostir._C unavailable: {hostir.cpp.reason()}")
        out.append(Variant(f"hostir_cpp_{s}", setup_hostir(s, "cpp"), cpp_skip))
        graph_skip = cpp_skip or ("--cpu: CUDA graphs need CUDA and NCCL" if ctx.cpu else None)
        out.append(Variant(f"hostir_cuda_graph_{s}", setup_hostir(s, "cpp", cuda_graph=True), graph_skip))
    out += decomposition_variants(ctx, names)
    skip = "--cpu: needs CUDA" if ctx.cpu else symm_mem_available()
    out.append(Variant("symm_mem", setup_symm_mem, skip, optional=True))
    return out


# ---------------------------------------------------------------- running


@dataclasses.dataclass
class Result:
    name: str
    status: str  # "ok", "failed", "skipped"
    note: str = ""
    match: bool | None = None  # on every rank
    max_abs_err: float | None = None  # over ranks
    times_ms: list[float] | None = None  # per iteration, max over ranks
    rank_medians_ms: list[float] | None = None
    # Host time of the call itself (enqueueing, not waiting), median over
    # iterations, max over ranks: where it nears median_ms the GPU waits
    # for the host.
    host_ms: float | None = None
    optional: bool = False

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:400]


def check(ctx: Context, out: torch.Tensor, expected: torch.Tensor, exact: bool) -> tuple[bool, float, str]:
    ctx.sync()
    if out.shape != expected.shape:
        return False, float("inf"), f"shape {list(out.shape)} != expected {list(expected.shape)}"
    err = (out.float() - expected.float()).abs().max().item() if out.numel() else 0.0
    tol = {"rtol": 0.0, "atol": 0.0} if exact else ctx.tolerances
    try:
        torch.testing.assert_close(out, expected, **tol)
    except AssertionError as exc:
        return False, err, " ".join(str(exc).split())[:300]
    return True, err, ""


def time_call(ctx: Context, call: Callable[[], object], iters: int, warmup: int) -> tuple[list[float], list[float]]:
    """This rank's time of each timed iteration and the host time of its
    call, in ms."""
    start = end = None
    if not ctx.cpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, host = [], []
    for i in range(warmup + iters):
        ctx.sync()
        ctx.barrier()
        if ctx.cpu:
            t0 = time.perf_counter()
            call()
            elapsed = (time.perf_counter() - t0) * 1e3
            host_ms = elapsed
        else:
            start.record()
            t0 = time.perf_counter()
            call()
            host_ms = (time.perf_counter() - t0) * 1e3
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        if i >= warmup:
            times.append(elapsed)
            host.append(host_ms)
    ctx.sync()
    return times, host


def run_variant(ctx: Context, v: Variant, args) -> Result:
    """Set up and check on every rank, agree, then time. The ranks agree
    after each phase, so one rank's failure skips the rest on all of them
    instead of leaving the others waiting in a collective."""
    if v.skip:
        return Result(v.name, "skipped", v.skip, optional=v.optional)
    mine = {"error": None, "match": None, "err": None, "note": ""}
    call = None
    try:
        call, expected = v.setup(ctx)
        out = call()
        mine["match"], mine["err"], mine["note"] = check(ctx, out, expected(), exact=v.name == "allgather_alone")
        del out
        if not mine["note"] and hasattr(call, "note"):
            mine["note"] = call.note()
    except Exception as exc:
        mine["error"] = _error_text(exc)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    everyone = ctx.gather(mine)
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
    if errors:
        return Result(v.name, "failed", "; ".join(errors), optional=v.optional)
    match = all(e["match"] for e in everyone)
    max_err = max(e["err"] for e in everyone)
    note = next((f"rank {r}: {e['note']}" for r, e in enumerate(everyone) if e["note"]), "")

    mine = {"error": None, "times": None, "host": None}
    try:
        mine["times"], mine["host"] = time_call(ctx, call, args.iters, args.warmup)
    except Exception as exc:
        mine["error"] = _error_text(exc)
    everyone = ctx.gather(mine)
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
    if errors:
        return Result(v.name, "failed", "timing: " + "; ".join(errors), match, max_err, optional=v.optional)
    if args.timeline and hasattr(call, "timeline"):
        stem = os.path.join(args.out_dir, f"timeline_{args.tag}_{v.name}")
        try:
            call.timeline(stem, stem + ".png")
        except Exception as exc:
            note = f"{note}; timeline not saved: {_error_text(exc)}".lstrip("; ")
    per_rank = [e["times"] for e in everyone]
    slowest = [max(ts) for ts in zip(*per_rank)]
    return Result(
        v.name,
        "ok",
        note,
        match,
        max_err,
        times_ms=slowest,
        rank_medians_ms=[statistics.median(ts) for ts in per_rank],
        host_ms=max(statistics.median(e["host"]) for e in everyone),
        optional=v.optional,
    )


# ---------------------------------------------------------------- reporting


def derived(results: list[Result]) -> dict[str, dict]:
    """Speedup over sequential, ratio to gemm_alone, overlap efficiency."""
    by_name = {r.name: r.median_ms for r in results if r.median_ms is not None}
    t_seq, t_gemm = by_name.get("sequential"), by_name.get("gemm_alone")
    t_ag = by_name.get("allgather_alone") or by_name.get("reduce_scatter_alone")
    out = {}
    for r in results:
        t = r.median_ms
        d = {"speedup_vs_sequential": None, "ratio_to_gemm_alone": None, "overlap_efficiency": None}
        if t:
            if t_seq:
                d["speedup_vs_sequential"] = t_seq / t
            if t_gemm:
                d["ratio_to_gemm_alone"] = t / t_gemm
            # Only meaningful for variants that do both the all-gather and the GEMM.
            if t_ag and t_gemm and r.name not in ("gemm_alone", "allgather_alone", "reduce_scatter_alone"):
                d["overlap_efficiency"] = (t_ag + t_gemm - t) / min(t_ag, t_gemm)
        out[r.name] = d
    return out


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(results: list[Result]) -> str:
    d = derived(results)
    lines = [
        "| variant | median ms | host ms | speedup vs sequential | / gemm_alone | overlap eff. | match | max abs err | note |",
        "|---|---:|---:|---:|---:|---:|:---:|---:|---|",
    ]
    for r in results:
        x = d[r.name]
        match = "—" if r.match is None else ("yes" if r.match else "no")
        note = r.note if r.status == "ok" else f"{r.status}: {r.note}"
        lines.append(
            f"| {r.name} | {_fmt(r.median_ms, '.3f')} | {_fmt(r.host_ms, '.3f')} | {_fmt(x['speedup_vs_sequential'], '.3f')} "
            f"| {_fmt(x['ratio_to_gemm_alone'], '.3f')} | {_fmt(x['overlap_efficiency'], '.2f')} "
            f"| {match} | {_fmt(r.max_abs_err, '.2e')} | {note.replace('|', '/')} |"
        )
    return "\n".join(lines)


def _nccl_version(cpu: bool) -> str:
    if cpu or not torch.cuda.is_available():
        return "n/a"
    try:
        return ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception as exc:
        return f"unknown ({exc})"


def environment(ctx: Context, args, launcher: str) -> dict:
    cuda = not ctx.cpu
    return {
        "device": torch.cuda.get_device_name(ctx.device) if cuda else (platform.processor() or "cpu"),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "world_size": ctx.world,
        "backend": "gloo" if ctx.cpu else "nccl",
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(ctx.cpu),
        "python": platform.python_version(),
        "hostir": hostir.__version__,
        "host": socket.gethostname(),
        "launcher": launcher,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "params": {"m": args.m, "k": args.k, "n": args.n, "iters": args.iters, "warmup": args.warmup},
    }


def markdown_report(results: list[Result], env: dict, done: bool) -> str:
    p = env["params"]
    what = "matmul+RS" if env.get("problem") == "rs" else "AG+matmul"
    lines = [
        f"# {what} overlap, {env['world_size']} ranks ({env['backend']}, {env['dtype']})",
        "",
    ]
    if not done:
        lines += ["**Partial: the run did not finish; the variants missing below never completed.**", ""]
    lines += [
        markdown_table(results),
        "",
        (
            f"Per rank: shard M={p['m']} rows, K={p['k']}, N={p['n']}; every rank computes the whole "
            f"[{env['world_size'] * p['m']}, {p['n']}] product."
            if what == "AG+matmul"
            else f"Total rows M={p['m']}, K={p['k']} per rank, N={p['n']}; each rank ends with its "
            f"[{p['m'] // env['world_size']}, {p['n']}] rows of the sum."
        )
        + " median ms: per iteration the slowest rank's "
        f"time ({'CUDA events' if env['backend'] == 'nccl' else 'time.perf_counter'} around the whole call, "
        f"ranks synchronized and at a barrier before each), median over {p['iters']} iterations after "
        f"{p['warmup']} warm-ups. overlap eff. = (T_allgather_alone + T_gemm_alone - T) / "
        "min(T_allgather_alone, T_gemm_alone). match: equal to the sequential result on every rank "
        "(all-gather: exactly equal to the gathered input). The hostir_<S> rows run with "
        'check_ranks="first"; the decompositions (hostir_ring_*, hostir_collective, hostir_sequential, '
        'hostir_auto) with the default, check_ranks="always".',
        "",
        f"- device: {env['device']} ({env['gpu_count']} GPUs visible, {env['world_size']} ranks)",
        f"- torch: {env['torch']}, CUDA: {env['cuda']}, NCCL: {env['nccl']}",
        f"- python: {env['python']}, hostir: {env['hostir']}, launcher: {env['launcher']}, host: {env['host']}",
        f"- date (UTC): {env['date']}",
    ]
    if p["iters"] < MIN_ITERS or p["warmup"] < MIN_WARMUP:
        lines.append(
            f"- fewer iterations than PERF.md asks for kept numbers (>= {MIN_ITERS} timed, >= {MIN_WARMUP} warm-up)"
        )
    lines += ["", "Run: `torchrun --standalone --nproc-per-node 2 tools/bench_overlap.py --tag <tag>`", ""]
    return "\n".join(lines)


def write_results(results: list[Result], env: dict, out_dir: str, tag: str, done: bool) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"bench_overlap_{tag}")
    d = derived(results)
    rows = []
    for r in results:
        row = dataclasses.asdict(r)
        row["median_ms"] = r.median_ms
        row.update(d[r.name])
        # Strict JSON has no NaN or Infinity (a NaN error means the variant
        # left part of its output unwritten).
        for key, value in row.items():
            if isinstance(value, float) and not math.isfinite(value):
                row[key] = str(value)
        rows.append(row)
    # Write then rename, so a run killed mid-write never leaves a torn file.
    for path, text in (
        (stem + ".md", markdown_report(results, env, done)),
        (stem + ".json", json.dumps({**env, "complete": done, "results": rows}, indent=2) + "\n"),
    ):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    return stem + ".md", stem + ".json"


# ---------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # --M/--K/--N spell the same: torchrun's own parser rejects a script's
    # --m and --n as ambiguous abbreviations of its options.
    ap.add_argument("--m", "--M", dest="m", type=int, default=16384, help="rows of each rank's shard (default: 16384)")
    ap.add_argument("--k", "--K", dest="k", type=int, default=8192, help="K (default: 8192)")
    ap.add_argument("--n", "--N", dest="n", type=int, default=4096, help="N (default: 4096)")
    ap.add_argument(
        "--iters", type=int, default=50, help=f"timed iterations per variant (default: 50; keep >= {MIN_ITERS})"
    )
    ap.add_argument(
        "--warmup", type=int, default=10, help=f"untimed iterations first (default: 10; keep >= {MIN_WARMUP})"
    )
    ap.add_argument(
        "--out-dir", default=DEFAULT_OUT_DIR, help="where rank 0 writes the .md and .json (default: benchmarks/results)"
    )
    ap.add_argument(
        "--no-timeline",
        dest="timeline",
        action="store_false",
        help="do not save one traced iteration per hostir variant (timeline_<tag>_<variant>.png and its traces)",
    )
    ap.add_argument(
        "--tag", default=None, help="file name suffix: bench_overlap_<tag>.md (default: cuda, or cpu with --cpu)"
    )
    ap.add_argument(
        "--cpu", action="store_true", help="smoke test: gloo, float32, CPU timers; no NCCL pipeline, no symm_mem"
    )
    ap.add_argument(
        "--problem", choices=("ag", "rs"), default="ag", help="ag: AG+matmul (default); rs: matmul+reduce-scatter"
    )
    ap.add_argument("--sweep", default="", help="comma list of total rows M: also run the AG+matmul M sweep")
    ap.add_argument("--sweep-only", action="store_true", help="run the --sweep alone, not the table at --m")
    ap.add_argument(
        "--variants",
        default="",
        help="comma list of shell patterns (hostir_ring*, symm_mem, ...): only the variants of the table at --m "
        "that match run (default: all)",
    )
    args = ap.parse_args(argv)
    for name in ("m", "k", "n", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    if not args.cpu and not torch.cuda.is_available():
        ap.error("CUDA is unavailable; pass --cpu for the gloo smoke test")
    args.tag = args.tag or ("cpu" if args.cpu else "cuda")
    try:
        args.sweep = [int(v) for v in args.sweep.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--sweep takes a comma list of integers, got {args.sweep!r}")
    if args.sweep_only and not args.sweep:
        ap.error("--sweep-only needs --sweep")
    args.variants = [v for v in args.variants.split(",") if v.strip()]
    args.out_dir = os.path.normpath(args.out_dir)
    return args


def selected(args, table: list[Variant]) -> list[Variant]:
    """The variants of `table` that --variants names (all when it names none)."""
    if not args.variants:
        return table
    return [v for v in table if any(fnmatch.fnmatchcase(v.name, pattern) for pattern in args.variants)]


def launcher_name() -> str:
    return hostir_communicator.discover().source


def teardown(ctx: Context) -> None:
    """Destroy the process groups, but never hang on it: a watchdog ends the
    process if teardown stalls (the results are written by now)."""

    def give_up():
        print(f"rank {ctx.rank}: process-group teardown did not finish in {TEARDOWN_SECONDS:g} s; exiting", flush=True)
        os._exit(0)

    watchdog = threading.Timer(TEARDOWN_SECONDS, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        # No rank may destroy a group another still uses.
        ctx.barrier()
        dist.destroy_process_group(ctx.ctl)
        # hostir owns the default group (it created it): its shutdown destroys it.
        hostir_communicator.shutdown()
    except Exception as exc:
        print(f"rank {ctx.rank}: teardown: {_error_text(exc)}", file=sys.stderr, flush=True)
    watchdog.cancel()
    watchdog.join()


def make_rs_inputs(args, rank: int, world: int, device: torch.device, dtype: torch.dtype):
    """This rank's a [M, K] and b [K, N] (its own K columns), from
    generators seeded by the rank."""

    def normal(shape, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    a = (normal((args.m, args.k), 2000 + rank) / 8).to(dtype)
    b = (normal((args.k, args.n), 3000 + rank) / math.sqrt(args.k)).to(dtype)
    return a, b


def run_table(ctx: Context, table: list[Variant], args, env: dict, tag: str, bootstrap_error=None) -> list[Result]:
    results: list[Result] = []
    # symm_mem last: after it, NCCL collectives and teardown were seen to hang.
    order = sorted(table, key=lambda v: (v.name != "hostir_1", v.name == "symm_mem"))
    for v in order:
        if v.name == "hostir_1" and bootstrap_error:
            results.append(Result(v.name, "failed", bootstrap_error))
        else:
            results.append(run_variant(ctx, v, args))
        if ctx.rank == 0:
            ranked = sorted(results, key=lambda r: [x.name for x in table].index(r.name))
            write_results(ranked, env, args.out_dir, tag, done=len(results) == len(table))
    results.sort(key=lambda r: [x.name for x in table].index(r.name))
    return results


SWEEP_VARIANTS = ("ring_cuda", "auto")


def run_sweep(args, rank, world, device, dtype, ctl, launcher) -> list[Result]:
    """AG+matmul at each total M: baselines and hostir's auto and ring."""
    rows, bad = [], []
    for total in args.sweep:
        if total % world:
            continue
        sub = argparse.Namespace(**{**vars(args), "m": total // world})
        x_full, shard, w = make_inputs(sub, rank, world, device, dtype)
        ctx = Context(args.cpu, rank, world, sub.m, args.k, args.n, dtype, device, x_full, shard, w, ctl=ctl)
        ctx.ref = make_sequential(ctx)().clone()
        ctx.sync()
        table = [
            v
            for v in variants(ctx, SWEEP_VARIANTS)
            if v.name in ("gemm_alone", "sequential", "symm_mem")
            or v.name.startswith("hostir_")
            and not v.name[7:].isdigit()
        ]
        table = selected(args, table)
        env = environment(ctx, sub, launcher)
        results = run_table(ctx, table, sub, env, f"{args.tag}_sweep_M{total}")
        d = derived(results)
        for r in results:
            rows.append(
                {
                    "M": total,
                    "variant": r.name,
                    "median_ms": r.median_ms,
                    "status": r.status,
                    "match": r.match,
                    **d[r.name],
                }
            )
            if not r.optional and (r.status == "failed" or r.match is False):
                bad.append(f"{r.name}@M={total}")
    if rank == 0:
        write_sweep(rows, args)
    return bad


def write_sweep(rows: list[dict], args) -> None:
    stem = os.path.join(args.out_dir, f"bench_overlap_{args.tag}_sweep")
    with open(stem + ".json", "w") as f:
        json.dump({"k": args.k, "n": args.n, "rows": rows}, f, indent=1, default=str)
    variants_ = list(dict.fromkeys(r["variant"] for r in rows))
    Ms = sorted({r["M"] for r in rows})
    by = {(r["M"], r["variant"]): r for r in rows}
    lines = [
        f"# AG+matmul M sweep (K={args.k}, N={args.n}): median ms (speedup over sequential)",
        "",
        "| variant | " + " | ".join(f"M={m}" for m in Ms) + " |",
        "|---|" + "---:|" * len(Ms),
    ]
    for v in variants_:
        cells = []
        for m in Ms:
            r = by.get((m, v))
            if r is None or r["median_ms"] is None:
                cells.append("—")
            else:
                sp = r["speedup_vs_sequential"]
                cells.append(f"{r['median_ms']:.3f}" + (f" ({sp:.2f}×)" if sp else ""))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # matplotlib is optional
        print(f"no plot: matplotlib unavailable ({exc})", flush=True)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in variants_:
        pts = [(m, by[(m, v)]) for m in Ms if (m, v) in by and by[(m, v)]["median_ms"] is not None]
        if not pts:
            continue
        ax1.plot([m for m, _ in pts], [r["median_ms"] for _, r in pts], marker="o", label=v)
        sp = [(m, r["speedup_vs_sequential"]) for m, r in pts if r["speedup_vs_sequential"]]
        if sp:
            ax2.plot([m for m, _ in sp], [x for _, x in sp], marker="o", label=v)
    for ax, title in ((ax1, "median ms"), (ax2, "speedup over sequential")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("total rows M")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {stem}.png", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, local = hostir.rank(), hostir.world_size(), hostir.local_rank()
    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda", local), torch.bfloat16
        torch.cuda.set_device(device)  # hostir requires inputs on cuda:local_rank
    x_full, shard, w = make_inputs(args, rank, world, device, dtype)
    ctx = Context(args.cpu, rank, world, args.m, args.k, args.n, dtype, device, x_full, shard, w)
    if args.problem == "rs":
        if args.m % world:
            raise SystemExit(f"--problem rs: M={args.m} must divide by the {world} ranks")
        a, b = make_rs_inputs(args, rank, world, device, dtype)
        ctx.problem, ctx.rs_a_local, ctx.rs_b_local = "rs", a, b
        ctx.rs_a = a.view(world, 1, args.m // world, args.k)
        ctx.rs_b = b.view(1, 1, args.k, args.n)
        ctx.rs_partial = a @ b
        table = rs_variants(ctx)
    else:
        table = variants(ctx)
    table = [] if args.sweep_only else selected(args, table)

    # hostir creates the process group on its first execute, so a hostir
    # program runs before anything uses torch.distributed directly. A
    # failure here is hostir_1's to report (the group exists by then unless
    # the launch itself is broken, which ends the run).
    bootstrap_error = None
    try:
        fd = build_hostir(ctx, 1)
        fd.execute([shard.view(1, 1, args.m, args.k), w], **hostir_kwargs(ctx, 1))
    except Exception as exc:
        bootstrap_error = _error_text(exc)
        if not dist.is_initialized():
            raise
        if rank == 0 and "hostir_1" not in [v.name for v in table]:
            print(f"the first hostir call failed: {bootstrap_error}", flush=True)
    ctx.ctl = dist.new_group(backend="gloo", timeout=timedelta(seconds=float(os.environ.get("HOSTIR_TIMEOUT", 300))))
    ctx.ref = (make_rs_sequential(ctx) if ctx.problem == "rs" else make_sequential(ctx))().clone()
    ctx.sync()

    env = environment(ctx, args, launcher_name())
    env["problem"] = args.problem
    results = run_table(ctx, table, args, env, args.tag, bootstrap_error)

    if rank == 0 and table:
        print(
            f"device: {env['device']} ({env['gpu_count']} GPUs visible)  ranks {world}  torch {env['torch']}  "
            f"CUDA {env['cuda']}  NCCL {env['nccl']}  hostir {env['hostir']}"
        )
        what = "matmul+RS, total M" if ctx.problem == "rs" else "AG+matmul, per rank M"
        print(f"{what}={args.m} K={args.k} N={args.n} {env['dtype']}, {args.iters} iters after {args.warmup} warm-ups")
        print(markdown_table(results))
        stem = os.path.join(args.out_dir, f"bench_overlap_{args.tag}")
        print(f"wrote {stem}.md and {stem}.json", flush=True)
    bad = [r.name for r in results if not r.optional and (r.status == "failed" or r.match is False)]
    if args.sweep:
        bad += run_sweep(args, rank, world, device, dtype, ctx.ctl, launcher_name())
    if bad and rank == 0:
        print(f"FAILED or mismatched: {', '.join(bad)}", flush=True)
    sys.stdout.flush()
    teardown(ctx)
    return 1 if bad else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The process groups are gone by now; skip the interpreter's own
    # teardown, where the destructors of cached NCCL and symmetric-memory
    # state could still hang or abort a process whose work is done.
    os._exit(code)
