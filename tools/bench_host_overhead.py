"""Host overhead per host op: Python evaluator, C++ executor, CUDA-graph replay.

Measures, side by side in one run, the host (CPU wall-clock) time that the
Python evaluator, the C++ executor (`hostir._C`) and a CUDA-graph replay of
the C++ executor's run (CUDA only) spend on programs made of many tiny ops,
where the device work is negligible and the runtime's own cost dominates,
against the same torch calls written by hand:

* ``hostir stream loop``: an input ``x`` of shape ``[S, W]`` and a chain of
  ``L`` elementwise ops (alternating ``add(y, 1.0)`` / ``mul(y, 1.0001)``),
  every intermediate and the output with axis 0 parallelized on
  ``ParallelType.stream``, so all ops merge into one stream loop of ``S``
  iterations (stream switches, synchronizations, slice selects and the ops).
* ``hostir flat``: the same chain with no stream axis: ``L`` top-level ops,
  the per-op cost without stream switches.
* ``eager chunked`` / ``eager flat``: the same per-chunk (or whole-tensor)
  torch calls written by hand, with ``out=`` writes into preallocated buffers
  and, on CUDA, the same ``torch.cuda`` stream switching: the reference cost
  of issuing the ops from plain Python.

Each run is timed with ``time.perf_counter`` around ``fd.execute(...)`` (or
the eager loop) after warm-up runs; the median over ``--iters`` runs is
reported. On CUDA, ``torch.cuda.synchronize()`` is called before each timed
run but not inside it, so the number is host time (kernel launches are
asynchronous). Host ops per run are read as the change of the program's
an ``OpCounter`` observer on the Python evaluator, or the C++ executor's own
``ops_executed``, across one run (a graph replay runs the C++ executor's
program, so its row counts that program's ops); compute ops per run (the
torch calls that do arithmetic) are ``S * L`` for the chunked variants and
``L`` for the flat ones.

Every timed call repeats the signature of the first (the same input
tensor), so `fd.execute` runs from its prepared record (`hostir.runtime.prepared`).
The ``core µs/run`` column times the part below `fd.execute` alone — the C++
executor's `run` for the cpp rows, `CUDAGraph.replay()` for the graph rows —
so that the Python around it is the difference; the ratio lines name each
target and whether this run meets it. There are two graph rows: ``cuda
graph`` passes the caller's tensor, which a replay copies into the graph's
input buffer (one copy kernel per call); ``cuda graph, own inputs`` passes
the graph's own buffer from `fd.graph_inputs`, so a replay copies nothing.

Run from the repository root:

    PYTHONPATH=python python3 tools/bench_host_overhead.py
    PYTHONPATH=python python3 tools/bench_host_overhead.py --device cpu --iters 50

It prints a markdown table and writes
``benchmarks/results/host_overhead_<device-type>.md`` and ``.json``
(``--out-dir`` to write elsewhere; ``$OUT`` when set).

``--multidevice`` (under a launcher, two or more ranks) times the host µs of
one steady-state multi-device execute of the AG+matmul layer
(`hostir.overlap.allgather_matmul`, tiny shapes) with each ``check_ranks``:
``every`` (the full agreement record and the full path on every call: the
cost before prepared multi-device calls), ``always`` (the default: the
signature agreed once, then a prepared call that checks a six-word step)
and ``first`` (prepared, unchecked), next to a single-device prepared call
of the same program (the same fusion without a mesh, on the whole input)
and the same work written in eager torch. Then it shows that the
protections still fire from prepared calls: rank 1 skips a call, and rank 1
passes shapes the ranks agreed on for another call; every rank's error is
printed and recorded. CPU on gloo:

    mpirun -np 2 --oversubscribe python3 tools/bench_host_overhead.py --multidevice --device cpu

One GPU, two ranks sharing it on the `cuda` copy-engine transport (gloo
process group), with ``$OUT`` set to where the results go:

    torchrun --standalone --nproc-per-node 2 tools/bench_host_overhead.py --multidevice --device cuda

It writes ``host_overhead_multidevice_<device-type>_np<N>.md`` and ``.json``.
On one host the steps of ``always`` go through the communicator's
shared-memory mailbox; ``HOSTIR_MAILBOX=0`` keeps them on the gloo control
group, for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

import hostir
import hostir.cpp
from hostir import FusionDefinition, ParallelType
from hostir.runtime.evaluator import OpCounter

ADD_SCALAR = 1.0
MUL_SCALAR = 1.0001
DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks", "results")


@dataclasses.dataclass
class Params:
    device: str
    chunks: int  # S: extent of the stream axis
    width: int  # W: extent of the inner axis
    length: int  # L: elementwise ops in the chain
    number_of_streams: int
    iters: int
    warmup: int


@dataclasses.dataclass
class Result:
    variant: str
    ops_per_run: int  # host ops (hostir) or torch calls (eager) per run
    compute_ops_per_run: int
    median_us: float  # median host time of one run
    # The part of a run below execute(): the C++ executor's own run
    # (`hostir._C.Executor.run`) or the graph's `replay()`; None elsewhere.
    core_us: float | None = None
    # The Python around it: the median of (a whole call - the core run
    # timed right after it).
    around_us: float | None = None

    @property
    def us_per_op(self) -> float:
        return self.median_us / self.ops_per_run

    @property
    def us_per_compute_op(self) -> float:
        return self.median_us / self.compute_ops_per_run

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "us_per_op": self.us_per_op,
            "us_per_compute_op": self.us_per_compute_op,
        }


# ---------------------------------------------------------------- programs


def _chain_op(i: int) -> str:
    return "add" if i % 2 == 0 else "mul"


def build_chain(length: int, stream_parallel: bool) -> FusionDefinition:
    """A fusion `x -> op_0 -> ... -> op_{L-1} -> out` of elementwise ops on a
    2-D input; with `stream_parallel`, axis 0 of every produced tensor is
    parallelized on streams, so all ops share one stream loop."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=torch.float32)
        y, produced = x, []
        for i in range(length):
            y = fd.ops.add(y, ADD_SCALAR) if _chain_op(i) == "add" else fd.ops.mul(y, MUL_SCALAR)
            produced.append(y)
        fd.add_output(y)
    if stream_parallel:
        for tv in produced:
            tv.axis(0).parallelize(ParallelType.stream)
    return fd


def eager_flat(x: torch.Tensor, length: int) -> torch.Tensor:
    """The chain on the whole tensor, one `out=` torch call per op."""
    bufs = [torch.empty_like(x) for _ in range(length)]
    y = x
    for i, buf in enumerate(bufs):
        if _chain_op(i) == "add":
            torch.add(y, ADD_SCALAR, out=buf)
        else:
            torch.mul(y, MUL_SCALAR, out=buf)
        y = buf
    return y


def eager_chunked(x: torch.Tensor, length: int, streams: list | None) -> torch.Tensor:
    """The stream loop by hand: for each chunk of axis 0, switch to a worker
    stream that waits for the caller, run the chain on the chunk's slices
    with `out=` writes, switch back and make the caller wait. `streams` is
    None on the CPU."""
    bufs = [torch.empty_like(x) for _ in range(length)]
    caller = torch.cuda.current_stream(x.device) if streams else None
    for s in range(x.shape[0]):
        if streams:
            worker = streams[s % len(streams)]
            torch.cuda.set_stream(worker)
            worker.wait_stream(caller)
        y = x[s]
        for i, buf in enumerate(bufs):
            out = buf[s]
            if _chain_op(i) == "add":
                torch.add(y, ADD_SCALAR, out=out)
            else:
                torch.mul(y, MUL_SCALAR, out=out)
            y = out
        if streams:
            torch.cuda.set_stream(caller)
            caller.wait_stream(worker)
    return bufs[-1]


# ---------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median host time of `fn()` in µs, over `iters` runs after `warmup`.
    The device is synchronized before each run, never inside the timed part."""
    return statistics.median(time_interleaved([fn], device, iters, warmup)[0]) * 1e6


def time_interleaved(fns: list, device: torch.device, iters: int, warmup: int) -> list[list[float]]:
    """The host times in seconds of `iters` runs of each of `fns`, as
    `time_runs` takes them, the functions' runs taken in turns (so that a
    busy machine slows them alike)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    _sync(device)
    gc.collect()
    samples = [[] for _ in fns]
    for _ in range(iters):
        for fn, found in zip(fns, samples):
            _sync(device)
            start = time.perf_counter()
            fn()
            found.append(time.perf_counter() - start)
    _sync(device)
    return samples


def core_and_around(whole: Callable[[], object], core: Callable[[], object], device, iters: int, warmup: int):
    """The median µs of `core()` and the median µs that a `whole()` run
    taken right before it spends more (the Python around the core)."""
    wholes, cores = time_interleaved([whole, core], device, iters, warmup)
    return (
        statistics.median(cores) * 1e6,
        statistics.median(w - c for w, c in zip(wholes, cores)) * 1e6,
    )


def bench_hostir(
    variant: str,
    fd: FusionDefinition,
    x: torch.Tensor,
    compute_ops: int,
    p: Params,
    expected: torch.Tensor,
    evaluator: str,
    cuda_graph: bool = False,
    ops_per_run: int | None = None,
    graph_inputs: bool = False,
) -> Result:
    if graph_inputs:
        # The graph's own input buffer (a clone of x): a replay copies nothing.
        (x,) = fd.graph_inputs([x], number_of_streams=p.number_of_streams, evaluator=evaluator, cuda_graph=True)

    def run():
        return fd.execute([x], number_of_streams=p.number_of_streams, evaluator=evaluator, cuda_graph=cuda_graph)

    (out,) = run()
    programs = list(fd.executor._programs.values())
    if len(programs) != 1:
        raise RuntimeError(f"{variant}: expected one lowered program, found {len(programs)}")
    ev = programs[0].evaluator
    if isinstance(ev, hostir.cpp.CppEvaluator):
        count = lambda: ev.ops_executed  # counted in C++, no callback per op
    else:
        counter = OpCounter()
        ev.observers.append(counter)
        count = lambda: counter.count
    _sync(x.device)
    torch.testing.assert_close(out, expected)
    if cuda_graph:
        median = time_runs(run, x.device, p.iters, p.warmup)
        (out,) = run()
        _sync(x.device)
        torch.testing.assert_close(out, expected)
        (captured,) = fd.executor._graphs._graphs.values()
        core, around = core_and_around(run, captured.graph.replay, x.device, p.iters, p.warmup)
        return Result(variant, ops_per_run, compute_ops, median, core, around)

    before = count()
    run()
    ops = count() - before

    before = count()
    median = time_runs(run, x.device, p.iters, p.warmup)
    total = count() - before
    if total != ops * (p.iters + p.warmup):
        raise RuntimeError(f"{variant}: host ops per run vary ({total} over {p.iters + p.warmup} runs, {ops} in one)")
    if fd.executor.num_programs != 1:
        raise RuntimeError(f"{variant}: the program was lowered again while timing")
    core = None
    if isinstance(ev, hostir.cpp.CppEvaluator):
        # The C++ run alone, in turns with whole calls (whose median here
        # is this pair's, not the row's).
        executor = ev._executor
        core, around = core_and_around(
            run, lambda: executor.run([x], [], p.number_of_streams), x.device, p.iters, p.warmup
        )
        return Result(variant, ops, compute_ops, median, core, around)
    return Result(variant, ops, compute_ops, median)


def bench_eager(variant: str, fn: Callable[[], torch.Tensor], compute_ops: int, p: Params, device) -> Result:
    with torch.no_grad():
        median = time_runs(fn, device, p.iters, p.warmup)
    return Result(variant, compute_ops, compute_ops, median)


def run_benchmark(p: Params) -> list[Result]:
    device = torch.device(p.device)
    x = torch.randn(p.chunks, p.width, dtype=torch.float32, device=device)
    expected = eager_flat(x, p.length)
    streams = None
    if device.type == "cuda":
        streams = [torch.cuda.Stream(device) for _ in range(p.number_of_streams)]
    torch.testing.assert_close(eager_chunked(x, p.length, streams), expected)

    chunked_ops, flat_ops = p.chunks * p.length, p.length
    results = []
    for shape, stream_parallel, compute_ops in (("stream loop", True, chunked_ops), ("flat", False, flat_ops)):
        runs = [
            bench_hostir(
                f"python {shape}", build_chain(p.length, stream_parallel), x, compute_ops, p, expected, "python"
            ),
        ]
        if hostir.cpp.available():
            runs.append(
                bench_hostir(f"cpp {shape}", build_chain(p.length, stream_parallel), x, compute_ops, p, expected, "cpp")
            )
            if device.type == "cuda":
                runs.append(
                    bench_hostir(
                        f"cuda graph {shape}",
                        build_chain(p.length, stream_parallel),
                        x,
                        compute_ops,
                        p,
                        expected,
                        "cpp",
                        cuda_graph=True,
                        ops_per_run=runs[-1].ops_per_run,
                    )
                )
                runs.append(
                    bench_hostir(
                        f"cuda graph, own inputs {shape}",
                        build_chain(p.length, stream_parallel),
                        x,
                        compute_ops,
                        p,
                        expected,
                        "cpp",
                        cuda_graph=True,
                        ops_per_run=runs[-1].ops_per_run,
                        graph_inputs=True,
                    )
                )
        if stream_parallel:
            runs.append(
                bench_eager("eager chunked", lambda: eager_chunked(x, p.length, streams), compute_ops, p, device)
            )
        else:
            runs.append(bench_eager("eager flat", lambda: eager_flat(x, p.length), compute_ops, p, device))
        results += runs
    return results


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def ratios(results: list[Result]) -> list[str]:
    """The comparisons the targets name, within this run, each with the
    target and whether this run meets it."""
    by = {r.variant: r for r in results}
    lines = []
    for shape, eager in (("stream loop", "eager chunked"), ("flat", "eager flat")):
        py, cc, graph = by.get(f"python {shape}"), by.get(f"cpp {shape}"), by.get(f"cuda graph {shape}")
        if cc is None:
            lines.append(f"- {shape}: the C++ executor is unavailable ({hostir.cpp.reason()})")
            continue
        vs_python = cc.us_per_op / py.us_per_op
        vs_eager = cc.us_per_compute_op / by[eager].us_per_compute_op
        line = f"- {shape}: C++ {cc.us_per_op:.2f} µs per host op"
        if shape == "stream loop":
            line += f" (target ≤ 3: {_met(cc.us_per_op <= 3.0)})"
        line += f" = {vs_python:.2f}x Python"
        if shape == "stream loop":
            line += f" (target ≤ 0.35x: {_met(vs_python <= 0.35)})"
        line += (
            f"; per compute op {cc.us_per_compute_op:.2f} µs = {vs_eager:.2f}x hand-written eager "
            f"(target ≤ 1x: {_met(vs_eager <= 1.0)})"
        )
        if cc.core_us is not None:
            line += f"; per run {cc.core_us:.1f} µs in the C++ run and {cc.around_us:.1f} in Python around it"
        lines.append(line)
        for row, how in (
            (graph, "the caller's input, copied in"),
            (by.get(f"cuda graph, own inputs {shape}"), "the graph's own input buffer (fd.graph_inputs)"),
        ):
            if row is None:
                continue
            line = f"- {shape}: CUDA-graph replay with {how}: {row.median_us:.1f} µs per run"
            if shape == "stream loop":
                line += f" (target ≤ 20: {_met(row.median_us <= 20.0)})"
            if row.core_us is not None:
                line += f": {row.core_us:.1f} in graph.replay() and {row.around_us:.1f} in Python around it"
            lines.append(line)
    return lines


# ---------------------------------------------------------------- reporting


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def environment(p: Params) -> dict:
    return {
        "device": device_name(torch.device(p.device)),
        "device_type": torch.device(p.device).type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "cpp_executor": hostir.cpp.available(),
        "python": platform.python_version(),
        "hostir": hostir.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "params": dataclasses.asdict(p),
    }


def markdown_table(results: list[Result]) -> str:
    lines = [
        "| variant | ops/run | compute ops/run | median µs/run | µs/op | µs/compute op | core µs/run | Python µs/run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        core = "" if r.core_us is None else f"{r.core_us:.1f}"
        around = "" if r.around_us is None else f"{r.around_us:.1f}"
        lines.append(
            f"| {r.variant} | {r.ops_per_run} | {r.compute_ops_per_run} | {r.median_us:.1f} "
            f"| {r.us_per_op:.2f} | {r.us_per_compute_op:.2f} | {core} | {around} |"
        )
    return "\n".join(lines)


def markdown_report(results: list[Result], env: dict) -> str:
    p = env["params"]
    return "\n".join(
        [
            f"# Host overhead per host-IR op ({env['device_type']})",
            "",
            markdown_table(results),
            "",
            *ratios(results),
            "",
            "ops/run: host ops executed by the evaluator (an observer on the Python evaluator, the C++ "
            "executor's own count) for the hostir rows, torch calls for "
            "the eager rows. µs/op = median host time of one run / ops per run. Host time only: the device "
            "is synchronized before each timed run, not inside it. core µs/run: the median of the part "
            "below `fd.execute` alone, timed the same way: `hostir._C.Executor.run` for the cpp rows, "
            "`CUDAGraph.replay()` for the graph rows; Python µs/run: the median, over whole calls each "
            "timed right before a core run, of the whole call's time minus the core run's.",
            "",
            f"- device: {env['device']}",
            f"- torch: {env['torch']} (CUDA {env['cuda']}, NCCL {env['nccl']})",
            f"- python: {env['python']}",
            f"- hostir: {env['hostir']}",
            f"- date (UTC): {env['date']}",
            f"- params: input [{p['chunks']}, {p['width']}] float32, chain of {p['length']} ops (add/mul), "
            f"number_of_streams={p['number_of_streams']}, iters={p['iters']}, warmup={p['warmup']}",
            "",
            "Run: `PYTHONPATH=python python3 tools/bench_host_overhead.py`",
            "",
        ]
    )


def write_results(results: list[Result], env: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"host_overhead_{env['device_type']}")
    with open(stem + ".md", "w") as f:
        f.write(markdown_report(results, env))
    with open(stem + ".json", "w") as f:
        json.dump({**env, "results": [r.as_dict() for r in results]}, f, indent=2)
        f.write("\n")
    return stem + ".md", stem + ".json"


# ---------------------------------------------------------------- multi-device

MULTI_ITERS = 300


def single_device_twin(D: int) -> FusionDefinition:
    """`overlap.allgather_matmul(D)` without a mesh: the same ops and the
    same stream loop over axis 0, on the whole input, on one device."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1, -1], dtype=torch.float32)
        w = fd.define_tensor(shape=[-1, -1], dtype=torch.float32)
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def _shown(fn) -> str:
    """The first line of the error `fn()` raises (every rank must raise)."""
    try:
        fn()
    except hostir.HostIrError as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "NO ERROR RAISED"


def protections(comm, rank: int, layer, other, kwargs: dict, make) -> dict[str, list[str]]:
    """From prepared calls (both signatures agreed before), rank 1 skips a
    call, then passes shapes agreed for another call: every rank's error."""
    small, large = make(3), make(6)
    for inputs in (small, large):
        for fd in (layer, other):
            for _ in range(2):
                fd.execute(inputs[0], **kwargs)
    found = {}
    odd = rank == 1
    # Rank 1 skips its call of `layer` and goes on to `other`; then the
    # others call `other` while rank 1 makes the call it skipped: the
    # counts are even again.
    found["rank 1 skips a call"] = _shown(lambda: (other if odd else layer).execute(small[0], **kwargs))
    _shown(lambda: (layer if odd else other).execute(small[0], **kwargs))
    found["rank 1 passes other (agreed) shapes"] = _shown(lambda: layer.execute((large if odd else small)[0], **kwargs))
    (y,) = layer.execute(small[0], **kwargs)
    torch.testing.assert_close(y, small[1])
    return {
        case: [m.decode(errors="replace") for m in comm.all_gather_bytes(text.encode()[:400], 400)]
        for case, text in found.items()
    }


def _multidevice_backend(device: torch.device) -> str:
    """NCCL where every rank of this node has a GPU of its own, else gloo
    (the CPU, or ranks sharing a GPU: NCCL cannot run two ranks on one)."""
    from hostir import communicator

    if device.type != "cuda":
        return "gloo"
    local = communicator.discover().local_size
    return "nccl" if local is not None and local <= torch.cuda.device_count() else "gloo"


def run_multidevice(args) -> int:
    from hostir import communicator, overlap

    device = torch.device(args.device)
    backend = args.backend or _multidevice_backend(device)
    comm = communicator.get(backend=backend)
    rank, world = comm.rank, comm.world_size
    if world < 2:
        raise SystemExit("--multidevice needs two or more ranks: run it under mpirun or torchrun")
    if device.type == "cuda":
        # Under gloo two ranks may share one GPU: the cuda transport moves the data.
        device = comm.device if backend == "nccl" else torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    schedule = args.schedule or ("ring:transport=cuda" if device.type == "cuda" else None)
    kwargs = {"backend": backend, "device": device}
    if schedule:
        kwargs["schedule"] = schedule
    m, K, N = args.m, args.k, args.n
    torch.manual_seed(0)

    def make(rows):
        X = torch.randn(world, rows, K, device=device)
        W = torch.randn(K, N, device=device)
        return overlap.allgather_matmul_inputs(X, W, rank)

    X, W = torch.randn(world, m, K, device=device), torch.randn(K, N, device=device)
    (x, w), expected = overlap.allgather_matmul_inputs(X, W, rank)
    layers = {mode: overlap.allgather_matmul(world) for mode in ("every", "always", "first")}
    twin = single_device_twin(world)
    gathered = torch.empty(world * m * K, device=device)
    all_gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor

    def eager_layer():
        # The same work by hand: gather the pieces, one matmul per block.
        all_gather(gathered, x.reshape(-1))
        return gathered.view(world, m, K) @ W

    rows = {
        "single-device prepared call (the same program, no mesh)": lambda: twin.execute([X, W], device=device),
        **{
            f"multi-device, check_ranks={mode}": (
                lambda fd=fd, mode=mode: fd.execute([x, w], check_ranks=mode, **kwargs)
            )
            for mode, fd in layers.items()
        },
        "eager torch matmul (single device)": lambda: X @ W,
    }
    if device.type == "cpu" or backend == "nccl":
        rows[f"eager all_gather + matmul ({backend}, by hand)"] = eager_layer
    for name, fn in rows.items():
        (out,) = [fn()] if name.startswith("eager") else fn()
        torch.testing.assert_close(out, expected if name.startswith("multi") else X @ W)
    for mode, fd in layers.items():
        if mode != "every" and len(fd.executor._prepared) != 1:
            raise RuntimeError(f"check_ranks={mode}: the steady-state calls are not prepared")
    samples = time_interleaved(list(rows.values()), device, args.iters, args.warmup)
    medians = [statistics.median(s) * 1e6 for s in samples]
    # Every rank's medians: the slowest rank is what a step waits for.
    everyone = comm.all_gather_words(torch.tensor([round(v * 1000) for v in medians])).tolist()
    shown = protections(comm, rank, overlap.allgather_matmul(world), overlap.allgather_matmul(world), kwargs, make)
    if rank != 0:
        return 0
    results = [
        {"variant": name, "median_us": medians[i], "median_us_per_rank": [r[i] / 1000 for r in everyone]}
        for i, name in enumerate(rows)
    ]
    env = {
        "device": device_name(device),
        "device_type": device.type,
        "ranks": world,
        "transport": "cuda (copy engine)" if "transport=cuda" in (schedule or "") else backend,
        "communicator": backend,
        "steps": "shared-memory mailbox" if comm.mailbox is not None else "gloo all-gather (control group)",
        "schedule": schedule or "the machine model's choice",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpp_executor": hostir.cpp.available(),
        "python": platform.python_version(),
        "hostir": hostir.__version__,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "params": {"m": m, "k": K, "n": N, "iters": args.iters, "warmup": args.warmup},
    }
    by = {r["variant"]: r["median_us"] for r in results}
    single = by["single-device prepared call (the same program, no mesh)"]
    lines = [
        f"# Host µs per steady-state multi-device execute ({device.type}, {world} ranks, {env['transport']})",
        "",
        "| variant | median µs/call (rank 0) | per rank |",
        "|---|---:|---|",
        *(
            f"| {r['variant']} | {r['median_us']:.1f} | {', '.join(f'{v:.1f}' for v in r['median_us_per_rank'])} |"
            for r in results
        ),
        "",
    ]
    for mode in ("every", "always", "first"):
        ratio = by[f"multi-device, check_ranks={mode}"] / single
        target = f" (target ≤ 2x with the protections on: {_met(ratio <= 2.0)})" if mode == "always" else ""
        lines.append(f"- check_ranks={mode}: {ratio:.2f}x the single-device prepared call{target}")
    before, after = by["multi-device, check_ranks=every"], by["multi-device, check_ranks=always"]
    lines.append(f"- always vs every (after vs before): {after:.1f} vs {before:.1f} µs, {before / after:.2f}x faster")
    hand = by.get("eager all_gather + matmul (gloo, by hand)")
    if hand is not None:
        lines.append(
            f"- above the same work by hand ({hand:.1f} µs): always +{after - hand:.1f} µs, "
            f"first +{by['multi-device, check_ranks=first'] - hand:.1f} µs; the single-device prepared call is "
            f"+{single - by['eager torch matmul (single device)']:.1f} µs above its eager matmul"
        )
    lines += ["", "## The protections, from prepared calls (every rank's error)", ""]
    for case, messages in shown.items():
        lines.append(f"- {case}:")
        lines += [f"  - rank {r}: `{text}`" for r, text in enumerate(messages)]
    lines += [
        "",
        "Each row: the median host time of one call over the timed calls, the rows taken in turns "
        "(every rank makes the same calls in the same order); on CUDA the device is synchronized "
        "before each timed call, not inside it. check_ranks=every is the path before prepared "
        "multi-device calls (the full record and the full path on every call).",
        "",
        f"- device: {env['device']} ({env['cpus']} CPUs, load average {', '.join(f'{v:.1f}' for v in env['load_average'])})",
        f"- torch: {env['torch']} (CUDA {env['cuda']}), python {env['python']}, hostir {env['hostir']}, "
        f"C++ executor {'built' if env['cpp_executor'] else 'not built'}",
        f"- steps of check_ranks=always exchanged through: {env['steps']} (HOSTIR_MAILBOX=0 keeps them on gloo)",
        f"- schedule: {env['schedule']}; x piece [1, {m}, {K}], w [{K}, {N}] float32; "
        f"iters={args.iters}, warmup={args.warmup}",
        f"- date (UTC): {env['date']}",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"host_overhead_multidevice_{device.type}_np{world}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump({**env, "results": results, "protections": shown}, f, indent=2)
        f.write("\n")
    print(f"wrote {stem}.md and {stem}.json")
    failed = [case for case, messages in shown.items() if any("NO ERROR" in m for m in messages)]
    return 1 if failed else 0


# ---------------------------------------------------------------- CLI


def parse_args(argv=None) -> tuple[Params, str]:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=default_device, help=f"device to run on (default: {default_device})")
    ap.add_argument("--chunks", type=int, default=8, help="S, extent of the stream axis (default: 8)")
    ap.add_argument("--width", type=int, default=8, help="W, extent of the inner axis (default: 8)")
    ap.add_argument("--length", type=int, default=16, help="L, elementwise ops in the chain (default: 16)")
    ap.add_argument("--streams", type=int, default=4, help="number_of_streams of the stream loop (default: 4)")
    ap.add_argument("--iters", type=int, default=200, help="timed runs per variant (default: 200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed runs before timing (default: 20)")
    ap.add_argument(
        "--out-dir",
        default=os.environ.get("OUT") or DEFAULT_OUT_DIR,
        help="where to write the .md and .json (default: $OUT, else benchmarks/results)",
    )
    ap.add_argument(
        "--multidevice", action="store_true", help="time steady-state multi-device executes (under a launcher)"
    )
    ap.add_argument(
        "--schedule", default=None, help="--multidevice: the layer's schedule (default: ring:transport=cuda on CUDA)"
    )
    ap.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="--multidevice: the communicator's backend (default: nccl where each rank has a GPU, else gloo)",
    )
    ap.add_argument("--m", type=int, default=4, help="--multidevice: rows of a rank's piece (default: 4)")
    ap.add_argument("--k", type=int, default=8, help="--multidevice: K (default: 8)")
    ap.add_argument("--n", type=int, default=8, help="--multidevice: N (default: 8)")
    args = ap.parse_args(argv)
    if args.multidevice:
        args.out_dir = os.path.normpath(args.out_dir)
        return args, None
    for name in ("chunks", "width", "length", "streams", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but CUDA is unavailable")
    params = Params(
        device=str(device),
        chunks=args.chunks,
        width=args.width,
        length=args.length,
        number_of_streams=args.streams,
        iters=args.iters,
        warmup=args.warmup,
    )
    return params, os.path.normpath(args.out_dir)


def main(argv=None) -> int:
    params, out_dir = parse_args(argv)
    if out_dir is None:
        return run_multidevice(params)
    results = run_benchmark(params)
    env = environment(params)
    print(f"device: {env['device']}  torch {env['torch']}  python {env['python']}  hostir {env['hostir']}")
    print(markdown_table(results))
    print("\n".join(ratios(results)))
    md, js = write_results(results, env, out_dir)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
