"""Host time of the ranks' agreement before each multi-device execute.

Run on every rank (CPU, gloo):

    mpirun -np 2 --oversubscribe python3 tools/bench_agreement.py --label after
    PYTHONPATH=/path/to/older/python mpirun -np 2 ... tools/bench_agreement.py --label before

It times, in one process group, (1) the agreement step alone, as the
executor runs it (the pickled `all_gather_object` of older versions, the
fixed-size int64 record of `hostir.runtime.agreement` now), and (2) a whole execute
of a small Allgather fusion with `check_ranks="every"` (the full record and
the full path on every call), "always" (since prepared multi-device calls:
a repeated call sends a six-word step; before them, the full record every
call) and "first" (which skips the agreement): their differences are what
the agreement costs a call. Then (3) the tiny-call ratio: a call of a
fusion that communicates nowhere (`x + x` on pieces sharded alike), with the
protections on (check_ranks="always"), and the Allgather with them on,
each against a single-device prepared call of `x + x` on the same local
piece (the target is at most 2x). Medians over --iters calls after
--warmup, max over ranks. Rank 0 appends a row to
benchmarks/results/agreement_cpu.json and rewrites the markdown table next
to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import time

import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def allgather_fd(d: int):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[d, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def doubled_fd(d: int | None):
    """x + x: on pieces sharded alike over `d` ranks (no communication), or
    on one device (`d` None)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[1 if d is None else d, -1])
        y = fd.ops.add(x, x)
        fd.add_output(y)
    if d is not None:
        for tv in (x, y):
            tv.set_device_mesh(DeviceMesh(range(d)))
            tv.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def median_us(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def agreement_step(fd, inputs):
    """The agreement step of this hostir version, as a thunk."""
    comm = hostir.communicator.get()
    program = next(iter(fd.executor._programs.values()))
    digest = program.lowered.digest
    try:
        from hostir.runtime import agreement
    except ImportError:
        from hostir import executor

        sig = executor.input_signature(inputs)
        return "pickle (all_gather_object)", lambda: executor.agree(comm, digest, sig, None)
    offer = agreement.Offer(fusion=0, call=0, digest=digest, inputs=agreement.input_signature(inputs), rank=comm.rank)
    return "int64 record (all_gather)", lambda: agreement.check(agreement.exchange(comm, offer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="what this run measures, e.g. before / after")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()

    d, rank = hostir.world_size(), hostir.rank()
    fd, x = allgather_fd(d)
    torch.manual_seed(0)
    full = torch.randn(d, args.rows)
    inputs = [shard_tensor(full, x)]
    (out,) = fd.execute(inputs)
    torch.testing.assert_close(out, full)

    quiet, qx = doubled_fd(d)
    quiet_inputs = [shard_tensor(torch.randn(d, args.rows), qx)]
    (doubled,) = quiet.execute(quiet_inputs)
    torch.testing.assert_close(doubled, quiet_inputs[0] * 2)
    single, _ = doubled_fd(None)
    piece = quiet_inputs[0].clone()
    (alone,) = single.execute([piece])
    torch.testing.assert_close(alone, piece * 2)

    layout, step = agreement_step(fd, inputs)
    timings = {
        "single-device prepared x + x": median_us(lambda: single.execute([piece]), args.iters, args.warmup),
        "execute without communication, check_ranks=always": median_us(
            lambda: quiet.execute(quiet_inputs), args.iters, args.warmup
        ),
        "agreement alone": median_us(step, args.iters, args.warmup),
        "execute, check_ranks=always": median_us(lambda: fd.execute(inputs), args.iters, args.warmup),
        "execute, check_ranks=every": median_us(
            lambda: fd.execute(inputs, check_ranks="every"), args.iters, args.warmup
        ),
        "execute, check_ranks=first": median_us(
            lambda: fd.execute(inputs, check_ranks="first"), args.iters, args.warmup
        ),
    }
    comm = hostir.communicator.get()
    worst = (
        comm.all_gather_words(torch.tensor([int(v * 1000) for v in timings.values()]))
        if hasattr(comm, "all_gather_words")
        else None
    )
    if worst is not None:
        maxima = worst.max(0).values.tolist()
    else:
        everyone = comm.all_gather_object(list(timings.values()))
        maxima = [max(r[i] for r in everyone) * 1000 for i in range(len(timings))]
    result = {name: round(v / 1000, 1) for name, v in zip(timings, maxima)}
    alone_us = result["single-device prepared x + x"]
    ratios = {
        "without communication / single-device": round(
            result["execute without communication, check_ranks=always"] / alone_us, 2
        ),
        "allgather, always / single-device": round(result["execute, check_ranks=always"] / alone_us, 2),
        "allgather, always / first": round(
            result["execute, check_ranks=always"] / result["execute, check_ranks=first"], 2
        ),
    }
    if rank == 0:
        row = {
            "label": args.label,
            "layout": layout,
            "ranks": d,
            "us": result,
            "ratios": ratios,
            "iters": args.iters,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        }
        print(json.dumps(row))
        write(row)
    hostir.communicator.shutdown()


def write(row: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "agreement_cpu.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append(row)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Agreement before each multi-device execute (CPU, gloo)",
        "",
        "`tools/bench_agreement.py` under `mpirun --oversubscribe` on a shared 2-core machine; median µs per",
        "call over the iterations, max over ranks. 'agreement alone' is the step the executor runs before",
        "a program; the execute rows differ by how much of it runs (`check_ranks`: 'every' is the full",
        "record on every call; 'always' was the same before prepared multi-device calls, a six-word step",
        "on a repeated call since; 'first' skips it).",
        "",
        "The last columns: a tiny call of a fusion without communication with the protections on",
        "('always'), and its ratio to a single-device prepared call of the same op on the same piece.",
        "",
        "| label | layout | ranks | agreement alone µs | execute (every) µs | execute (always) µs | execute (first) µs "
        "| single-device µs | no communication (always) µs | ratio | torch | date |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        us = r["us"]
        ratio = r.get("ratios", {}).get("without communication / single-device", "–")
        lines.append(
            f"| {r['label']} | {r['layout']} | {r['ranks']} | {us['agreement alone']} | "
            f"{us.get('execute, check_ranks=every', '–')} | {us['execute, check_ranks=always']} | "
            f"{us['execute, check_ranks=first']} | {us.get('single-device prepared x + x', '–')} | "
            f"{us.get('execute without communication, check_ranks=always', '–')} | {ratio} | "
            f"{r['torch']} | {r['date']} |"
        )
    (RESULTS / "agreement_cpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
