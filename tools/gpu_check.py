"""Every GPU check of hostir in one script, for any machine with GPUs.

Run from the repository root on the GPU machine (python3 with a CUDA torch,
pytest, pytest-timeout and hypothesis; Open MPI's mpirun and torchrun for
the multi-device steps):

    python3 tools/gpu_check.py                     # every part
    python3 tools/gpu_check.py --part build,single  # some parts
    python3 tools/gpu_check.py --part suite --world-sizes 2

It finds the GPU count, then runs, each step under a time limit and with
its own log:

- `build`: the C++ executor against this torch (`setup.py build_ext
  --inplace`, timed), and that it loads;
- `single`: the `cuda`-marked tests on one GPU, one process;
- `suite`: `tests/python/multidevice`, launched once as a whole, at every
  world size the machine allows (2, 4, 8), under torchrun and under
  Open MPI's mpirun, with the rings on NCCL and again on the copy-engine
  transport (`HOSTIR_TEST_TRANSPORT=cuda`);
- `examples`: the README's examples on one GPU and on every world size.

Each rank of a launched job writes a log of its own, so one rank's failure
is never hidden in the other's output. The summary (device, versions,
every step's result and time) goes to
`benchmarks/results/gpu_check_<machine>.md` and to `--out` with the logs
packed into one archive. Parts run before, on the same checkout, are kept
in the summary (`.gpu_check/parts.json`), so a run split with `--part`
across calls still ends in one table. The default limits end a whole run
in about nine minutes on 2 GPUs; `--budget` caps the total. Leftover ranks
are killed after each step and at exit. Exit status 0 when every step ran
and passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tarfile

from benchlib import REPO, Runner, job_env, machine_tag, pytest_results

STATE = REPO / ".gpu_check"
PARTS = ("build", "single", "suite", "examples")
MULTIDEVICE = "tests/python/multidevice"


def versions() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "date": datetime.date.today().isoformat(),
    }
    mpirun = shutil.which("mpirun")
    if mpirun:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout.splitlines()
        info["mpirun"] = f"{mpirun} ({out[0] if out else '?'})"
    info["torchrun"] = shutil.which("torchrun")
    info["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    return info


def launch(launcher: str, nprocs: int, program: list[str], log_prefix: pathlib.Path, env: dict[str, str]) -> list[str]:
    """The command that runs `program` on `nprocs` ranks, each rank's output
    in `log_prefix.rankN.log` (tools/gpu_check.py --rank-log)."""
    ranked = [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--rank-log", str(log_prefix), "--", *program]
    if launcher == "torchrun":
        return [
            shutil.which("torchrun") or "torchrun",
            "--standalone",
            f"--nproc-per-node={nprocs}",
            "--no-python",
            *ranked,
        ]
    exports = []
    for name in (
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        "HOSTIR_MASTER_ADDR",
        "HOSTIR_MASTER_PORT",
        "HOSTIR_TIMEOUT",
        "HOSTIR_TEST_TRANSPORT",
        "PATH",
        "VIRTUAL_ENV",
        "TORCH_DISTRIBUTED_DEBUG",
    ):
        if name in env:
            exports += ["-x", name]
    return [
        shutil.which("mpirun") or "mpirun",
        "--allow-run-as-root",
        "-np",
        str(nprocs),
        "--oversubscribe",
        "--bind-to",
        "none",
        *exports,
        *ranked,
    ]


def rank_log(prefix: str, command: list[str]) -> int:
    """Run `command` with this rank's output in PREFIX.rankN.log and a
    one-line outcome on the launcher's output."""
    rank = next((os.environ[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if v in os.environ), "0")
    path = pathlib.Path(f"{prefix}.rank{rank}.log")
    with open(path, "w") as f:
        rc = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT)
    text = path.read_text(errors="replace")
    print(f"rank {rank}: exit {rc}; {pytest_results(text) or text.strip().splitlines()[-1:]}", flush=True)
    return rc


def ranks_passed(nprocs: int, prefix: pathlib.Path):
    """A check that every rank's pytest reported passes and no failure."""

    def check(_text: str) -> str | None:
        problems = []
        for rank in range(nprocs):
            path = pathlib.Path(f"{prefix}.rank{rank}.log")
            if not path.exists():
                problems.append(f"rank {rank} wrote no log")
                continue
            body = pytest_results(path.read_text(errors="replace"))
            if "passed" not in body or re.search(r"\d+ (failed|errors?)", body):
                problems.append(f"rank {rank}: {body or 'no pytest summary'}")
        return "; ".join(problems) or None

    return check


def part_build(run: Runner) -> None:
    for stale in list((REPO / "python" / "hostir").glob("_C*.so")):
        stale.unlink()
    jobs = str(max(1, min(16, os.cpu_count() or 1)))
    run.step("build", 400, [sys.executable, "setup.py", "build_ext", "--inplace"], env=job_env({"MAX_JOBS": jobs}))
    run.step(
        "build_loads",
        60,
        [
            sys.executable,
            "-c",
            "from hostir import cpp; assert cpp.available(), cpp.reason(); print('C++ executor loads')",
        ],
        env=job_env(),
    )


def part_single(run: Runner) -> None:
    run.step(
        "single_gpu_cuda_tests",
        300,
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "--tb=short",
            "-p",
            "no:cacheprovider",
            "-m",
            "cuda",
            "tests/python",
            "--timeout=240",
        ],
        env=job_env({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0") or "0"}),
    )


def part_suite(run: Runner, world_sizes: list[int], launchers: list[str], transports: list[str]) -> None:
    for n in world_sizes:
        for transport in transports:
            for launcher in launchers:
                name = f"suite_np{n}_{launcher}_{transport}"
                prefix = run.logs / name
                # A small peer timeout: a desynchronized test fails fast. No
                # TORCH_DISTRIBUTED_DEBUG=DETAIL (the CPU suite's setting): its
                # wrapper of NCCL groups lacks the coalesced all-gather that
                # DTensor's redistribute posts ("Backend nccl does not support
                # allgather_into_tensor_coalesced").
                env = job_env({"HOSTIR_TIMEOUT": "30"})
                env.pop("TORCH_DISTRIBUTED_DEBUG", None)
                env.pop("HOSTIR_TEST_TRANSPORT", None)
                if transport != "nccl":
                    env["HOSTIR_TEST_TRANSPORT"] = transport
                program = [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-v",
                    "-rfE",
                    "--tb=short",
                    "-p",
                    "no:cacheprovider",
                    "--color=no",
                    MULTIDEVICE,
                    "--timeout=120",
                ]
                run.step(
                    name,
                    240,
                    launch(launcher, n, program, prefix, env),
                    env=env,
                    check=ranks_passed(n, prefix),
                    ranks=n,
                )


def part_examples(run: Runner, world_sizes: list[int]) -> None:
    run.step("example_stream_parallel", 120, [sys.executable, "examples/stream_parallel_matmul.py"], env=job_env())
    for n in world_sizes:
        for launcher in ("torchrun", "mpirun"):
            name = f"example_sequence_parallel_np{n}_{launcher}"
            prefix = run.logs / name
            env = job_env()

            def matched(_text, n=n, prefix=prefix):
                missing = [
                    r
                    for r in range(n)
                    if "matches eager torch" not in pathlib.Path(f"{prefix}.rank{r}.log").read_text(errors="replace")
                ]
                return f"ranks {missing} did not match" if missing else None

            run.step(
                name,
                120,
                launch(launcher, n, [sys.executable, "examples/sequence_parallel_matmul.py"], prefix, env),
                env=env,
                check=matched,
                ranks=n,
            )


def write_summary(run: Runner, info: dict, tag: str, out: pathlib.Path) -> pathlib.Path:
    parts_file = STATE / "parts.json"
    earlier = json.loads(parts_file.read_text()) if parts_file.exists() else {}
    if earlier.get("gpus") != info["gpus"] or earlier.get("torch") != info["torch"]:
        earlier = {"steps": []}
    names = {s["step"] for s in run.steps}
    steps = [s for s in earlier.get("steps", []) if s["step"] not in names] + run.steps
    parts_file.write_text(json.dumps({**info, "steps": steps}, indent=1))
    ok = all(s["status"] == "passed" for s in steps)
    lines = [
        f"# GPU check on {len(info['gpus'])} × {info['gpus'][0] if info['gpus'] else 'no GPU'}",
        "",
        f"`python3 tools/gpu_check.py` on {info['date']}: torch {info['torch']}, CUDA {info['cuda']}, "
        f"NCCL {info['nccl']}, Python {info['python']}; mpirun {info.get('mpirun')}; NCCL variables "
        f"as the machine set them: {info['nccl_env'] or 'none'}.",
        "",
        f"**{'Every step passed.' if ok else 'Not every step passed.'}**",
        "",
        "| step | result | seconds | tests (per rank) |",
        "|---|---|---:|---|",
    ]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s.get('detail', '')} |" for s in steps]
    text = "\n".join(lines) + "\n"
    results = REPO / "benchmarks" / "results" / f"gpu_check_{tag}.md"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / results.name).write_text(text)
    with tarfile.open(out / "gpu_check_logs.tgz", "w:gz") as tar:
        tar.add(run.logs, arcname="logs")
    print(text, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-log"]:
        sep = argv.index("--")
        return rank_log(argv[1], argv[sep + 1 :])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--world-sizes", default=None, help="comma-separated; default 2, 4, 8 up to the GPU count")
    p.add_argument("--launchers", default="torchrun,mpirun")
    p.add_argument("--transports", default="nccl,cuda")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/hostir-gpu-check"))
    args = p.parse_args(argv)
    parts = [x for x in args.part.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {unknown}: expected some of {PARTS}")
    info = versions()
    count = len(info["gpus"])
    if count == 0:
        print("gpu_check: no CUDA device is visible; this script is for GPU machines", file=sys.stderr)
        return 2
    sizes = [int(x) for x in args.world_sizes.split(",")] if args.world_sizes else [n for n in (2, 4, 8) if n <= count]
    too_many = [n for n in sizes if n > count]
    if too_many:
        p.error(f"world sizes {too_many} need more than the {count} GPUs visible")
    print(json.dumps(info, indent=1), flush=True)
    run = Runner(STATE / "logs", args.budget)
    if "build" in parts:
        part_build(run)
    if "single" in parts:
        part_single(run)
    if "suite" in parts and sizes:
        part_suite(run, sizes, args.launchers.split(","), args.transports.split(","))
    if "examples" in parts:
        part_examples(run, sizes)
    write_summary(run, info, machine_tag(info["gpus"]), pathlib.Path(args.out))
    return 0 if all(s["status"] == "passed" for s in run.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
