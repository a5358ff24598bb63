"""What profiler ranges and traces cost per host op.

Runs one stream-parallel program of many tiny ops (a chain of `L`
elementwise ops on `[S, W]`, every tensor's axis 0 on `stream`, so one loop
of `S` iterations holds stream switches, synchronizations, slices and the
ops) in four modes and reports the median host time per host op:

* ``off``: nothing watches the run (the default): the evaluator pays one
  ``is None`` test per op.
* ``profiler``: inside ``torch.profiler.profile()``: a ``record_function``
  range per op (and an NVTX range on CUDA).
* ``trace``: ``fd.execute(..., trace=DIR)``: a trace event per op (on CUDA,
  two CUDA events per op and one synchronization per run).
* ``profiler+trace``: both.

Host ops per run are counted by an ``OpCounter`` observer across one run. On CUDA,
``torch.cuda.synchronize()`` runs before each timed run, not inside it.

    PYTHONPATH=python python3 tools/bench_profiling.py               # cpu
    PYTHONPATH=python python3 tools/bench_profiling.py --device cuda

It prints a markdown table and writes
``benchmarks/results/profiling_cost_<device-type>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Iterator

import torch

import hostir
from hostir import FusionDefinition, ParallelType
from hostir.runtime import profiling
from hostir.runtime.evaluator import OpCounter

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks", "results")


def build(chain: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = x
        made = []
        for i in range(chain):
            y = fd.ops.add(y, 1.0) if i % 2 == 0 else fd.ops.mul(y, 1.0001)
            made.append(y)
        fd.add_output(y)
    for tv in made:
        tv.axis(0).parallelize(ParallelType.stream)
    return fd


def _program_evaluator(fd: FusionDefinition):
    (program,) = fd.executor._programs.values()
    return program.evaluator


@contextlib.contextmanager
def _mode(name: str, trace_dir: str) -> Iterator[dict]:
    options: dict = {}
    if "trace" in name:
        options["trace"] = trace_dir
    if "profiler" in name:
        with torch.profiler.profile(record_shapes=False) as prof:
            yield options
        del prof
    else:
        yield options


def measure(device: str, streams: int, width: int, chain: int, iters: int, warmup: int) -> dict:
    fd = build(chain)
    x = torch.randn(streams, width, device=device)
    fd.execute([x], number_of_streams=streams)
    ev = _program_evaluator(fd)
    counter = OpCounter()
    ev.observers.append(counter)
    fd.execute([x], number_of_streams=streams)
    ev.observers.remove(counter)
    ops = counter.count
    sync: Callable[[], None] = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = {}
    with tempfile.TemporaryDirectory() as trace_dir:
        for name in ("off", "profiler", "trace", "profiler+trace"):
            times = []
            with _mode(name, trace_dir) as options:
                for i in range(warmup + iters):
                    sync()
                    start = time.perf_counter()
                    fd.execute([x], number_of_streams=streams, **options)
                    elapsed = time.perf_counter() - start
                    if i >= warmup:
                        times.append(elapsed)
            median = statistics.median(times)
            rows[name] = {"run_us": median * 1e6, "per_op_us": median * 1e6 / ops}
    off = rows["off"]["per_op_us"]
    for row in rows.values():
        row["added_per_op_us"] = row["per_op_us"] - off
    # What the off path adds to a run without any profiling code: one
    # observer_for() per run and one `is None` test per op.
    container, streams = ev.container, ev.streams
    n = 20000
    per_run = timeit.timeit(lambda: profiling.observer_for(container, streams, 0), number=n) / n
    observer = None
    per_test = timeit.timeit("observer is None", globals={"observer": observer}, number=n * 10) / (n * 10)
    off_path = {"observer_for_per_run_us": per_run * 1e6, "is_none_per_op_us": per_test * 1e6}
    return {"host_ops_per_run": ops, "modes": rows, "off_path": off_path}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", type=int, default=4, help="chunks of the stream loop (S)")
    parser.add_argument("--width", type=int, default=64, help="elements per chunk (W)")
    parser.add_argument("--chain", type=int, default=16, help="elementwise ops (L)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)

    result = measure(args.device, args.streams, args.width, args.chain, args.iters, args.warmup)
    device_type = torch.device(args.device).type
    name = torch.cuda.get_device_name() if device_type == "cuda" else platform.processor() or platform.machine()
    meta = {
        "device": name,
        "torch": torch.__version__,
        "hostir": hostir.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "streams": args.streams,
        "width": args.width,
        "chain": args.chain,
        "iters": args.iters,
    }
    lines = [
        f"# Profiling cost per host op ({device_type}: {name})",
        "",
        f"torch {meta['torch']}, hostir {meta['hostir']}, Python {meta['python']}, {meta['date']}; "
        f"{result['host_ops_per_run']} host ops per run (S={args.streams}, W={args.width}, L={args.chain}), "
        f"median of {args.iters} runs.",
        "",
        "| mode | µs per run | µs per host op | added µs per op |",
        "|---|---:|---:|---:|",
    ]
    for mode, row in result["modes"].items():
        lines.append(
            f"| {mode} | {row['run_us']:.1f} | {row['per_op_us']:.2f} | {row['added_per_op_us']:+.2f} |"
        )
    off_path = result["off_path"]
    lines += [
        "",
        f"The off path (no profiler, no trace) adds {off_path['observer_for_per_run_us']:.3f} µs per run "
        f"(`observer_for`) and {off_path['is_none_per_op_us'] * 1000:.0f} ns per op (an `is None` test), "
        f"{(off_path['observer_for_per_run_us'] / result['host_ops_per_run'] + off_path['is_none_per_op_us']) * 1000:.0f} "
        f"ns per op in all here. A trace run's time includes writing its JSON file.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"profiling_cost_{device_type}")
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump({**meta, **result}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
