"""The `hostir` command line (`python -m hostir`, or the `hostir` script).

    hostir dump SCRIPT [--rank R --world-size D] [--pass NAME] [-- ARGS]
        run SCRIPT as rank R of D up to its first `fd.execute`, and print the
        host program that fusion lowers to for that rank, without running it
        (with --pass, the program after that lowering pass); a torch mesh
        the script builds has fake peers (`hostir.plan.fake_world`), so no
        rendezvous waits for ranks
    hostir run [-n N] [--launcher auto|mpirun|torchrun|srun] SCRIPT [ARGS]
        start SCRIPT on N processes with a launcher (inside a Slurm
        allocation srun, else mpirun if it is on PATH, else torchrun) and a
        rendezvous (HOSTIR_MASTER_ADDR/HOSTIR_MASTER_PORT, a free port)
    hostir env [--json]
        what hostir sees: launcher variables, the process it would be,
        backend, devices, P2P access between GPUs, extension, versions
    hostir plan ...
        the analyses' command line, `python -m hostir.plan`, where installed
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import runpy
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from hostir import communicator, lower, plan
from hostir._version import __version__
from hostir.communicator import LAUNCHER_VARIABLES
from hostir.errors import HostIrError
from hostir.executor import FusionExecutor
from hostir.runtime.checks import is_multi_device

__all__ = ["main"]


# ---------------------------------------------------------------- dump


class CommandLineError(HostIrError, ValueError):
    """A command's arguments cannot be acted on; `main` exits with it."""


class _Stop(HostIrError):
    """Ends a dumped script at its first execute."""


def host_program(fusion: Any, rank: int, pass_name: str | None = None, backend: str = "gloo") -> str:
    """The dump of `fusion`'s host program for `rank`, after `pass_name`
    (default: all passes)."""
    names = lower.pass_names()
    if pass_name is not None and pass_name not in names:
        raise CommandLineError(f"hostir dump: unknown pass {pass_name!r}; passes in order: {', '.join(names)}")
    multi = is_multi_device(fusion)
    options = lower.LoweringOptions(rank=rank if multi else None, backend=backend)
    return str(lower.lower(fusion, options, until=pass_name).program)


@contextlib.contextmanager
def _as_rank(rank: int, world_size: int) -> Iterator[None]:
    """The launcher variables of rank `rank` of `world_size` (torchrun's),
    with every other launcher's removed, for the block."""
    saved = dict(os.environ)
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _dump(args: argparse.Namespace) -> int:
    if args.rank is not None and args.world_size is None:
        raise CommandLineError("hostir dump: --rank needs --world-size")
    world = args.world_size or 1
    rank = args.rank or 0
    if not 0 <= rank < world:
        raise CommandLineError(f"hostir dump: --rank {rank} is out of range for --world-size {world}")
    names = lower.pass_names()
    if args.pass_name is not None and args.pass_name not in names:
        raise CommandLineError(f"hostir dump: unknown pass {args.pass_name!r}; passes in order: {', '.join(names)}")
    found: list[Any] = []
    original = FusionExecutor.execute

    # Caught where the executor takes the call: after DTensor inputs
    # placed the fusion's inputs, and for a call under autograd (a
    # hostir.parallel Linear's) the training forward's fusion.
    def capture(executor: FusionExecutor, *a: Any, **k: Any) -> Any:
        found.append(executor.fusion)
        raise _Stop

    FusionExecutor.execute = capture  # type: ignore[method-assign,assignment]
    argv = sys.argv
    sys.argv = [args.script, *args.script_args]
    try:
        # A script that builds a torch mesh meets fake peers, not a rendezvous.
        with _as_rank(rank, world), plan.fake_world(rank, world):
            runpy.run_path(args.script, run_name="__main__")
    except _Stop:
        pass
    except Exception:
        # A script that caught the stop and failed later still lowered.
        if not found:
            raise
    finally:
        FusionExecutor.execute = original  # type: ignore[method-assign]
        sys.argv = argv
    if not found:
        raise CommandLineError(f"hostir dump: {args.script} ran to its end without calling fd.execute")
    title = f"rank {rank} of {world}" + (f", after pass {args.pass_name}" if args.pass_name else "")
    print(f"# {args.script}: host program, {title}")
    print(host_program(found[0], rank, args.pass_name, args.backend), end="")
    return 0


# ---------------------------------------------------------------- run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pick_launcher(requested: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    if requested != "auto":
        return requested
    if "SLURM_JOB_ID" in environ and shutil.which("srun"):
        return "srun"
    if shutil.which("mpirun"):
        return "mpirun"
    return "torchrun"


def launch_command(launcher: str, nprocs: int, script: str, script_args: Sequence[str], addr: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command that starts `script` on `nprocs` processes, and the
    variables it adds to the environment."""
    program = [sys.executable, script, *script_args]
    exports = {"HOSTIR_MASTER_ADDR": addr, "HOSTIR_MASTER_PORT": str(port)}
    if launcher == "mpirun":
        command = ["mpirun", "-np", str(nprocs), "--oversubscribe"]
        for name, value in exports.items():
            command += ["-x", f"{name}={value}"]
        return command + program, exports
    if launcher == "torchrun":
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
            "--master-addr", addr, "--master-port", str(port),
        ]
        # torchrun's own store holds MASTER_PORT; hostir's rendezvous needs another.
        exports["HOSTIR_MASTER_PORT"] = str(_free_port())
        return command + [script, *script_args], exports
    if launcher == "srun":
        return ["srun", "--ntasks", str(nprocs), *program], exports
    raise CommandLineError(f"hostir run: unknown launcher {launcher!r}; expected auto, mpirun, torchrun or srun")


def _run(args: argparse.Namespace) -> int:
    if args.nprocs < 1:
        raise CommandLineError(f"hostir run: -n must be at least 1, got {args.nprocs}")
    launcher = pick_launcher(args.launcher)
    if launcher != "torchrun" and launcher != "auto" and not shutil.which(launcher):
        raise CommandLineError(f"hostir run: {launcher} is not on PATH")
    addr = os.environ.get("HOSTIR_MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("HOSTIR_MASTER_PORT") or _free_port())
    command, exports = launch_command(launcher, args.nprocs, args.script, args.script_args, addr, port)
    if launcher == "mpirun":
        # Open MPI refuses root without these; the printed command carries
        # them too, so that it runs as printed.
        exports.setdefault("OMPI_ALLOW_RUN_AS_ROOT", os.environ.get("OMPI_ALLOW_RUN_AS_ROOT", "1"))
        exports.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"))
    if args.dry_run:
        print(" ".join(f"{k}={v}" for k, v in exports.items()), " ".join(command))
        return 0
    return subprocess.call(command, env=dict(os.environ, **exports))


# ---------------------------------------------------------------- env


def environment() -> dict[str, Any]:
    """What hostir sees in this process."""
    import torch

    info: dict[str, Any] = {
        "versions": {
            "hostir": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
        },
        "launcher_variables": {k: os.environ[k] for k in communicator.LAUNCHER_VARIABLES if k in os.environ},
        "rendezvous": {
            k: os.environ[k]
            for k in ("HOSTIR_MASTER_ADDR", "HOSTIR_MASTER_PORT", "MASTER_ADDR", "MASTER_PORT", "HOSTIR_TIMEOUT")
            if k in os.environ
        },
    }
    try:
        launch = communicator.discover()
        info["process"] = {
            "rank": launch.rank,
            "world_size": launch.world_size,
            "local_rank": launch.local_rank,
            "source": launch.source,
        }
    except communicator.LaunchError as err:
        info["process"] = {"error": str(err)}
    cuda = torch.cuda.is_available()
    info["backend"] = "nccl" if cuda else "gloo"
    count = torch.cuda.device_count() if cuda else 0
    info["devices"] = [torch.cuda.get_device_name(i) for i in range(count)] or ["cpu"]
    info["p2p_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)] for i in range(count)]
    if cuda:
        nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        info["versions"]["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    info["extension"] = "built" if importlib.util.find_spec("hostir._C") is not None else "not built"
    for module in ("mpi4py", "matplotlib", "cupy"):
        try:
            info["versions"][module] = getattr(importlib.import_module(module), "__version__", "installed")
        except ImportError:
            info["versions"][module] = None
    info["mpirun"] = shutil.which("mpirun")
    return info


def _env(args: argparse.Namespace) -> int:
    info = environment()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for section, value in info.items():
        if isinstance(value, dict):
            print(f"{section}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        elif section == "p2p_access" and value:
            print("p2p_access (row can access column):")
            for i, row in enumerate(value):
                print(f"  gpu {i}: " + " ".join("y" if ok else "n" for ok in row))
        else:
            print(f"{section}: {value}")
    return 0


# ---------------------------------------------------------------- plan


def _plan(args: argparse.Namespace) -> int:
    try:
        return plan.main(list(args.plan_args))
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else 1


# ---------------------------------------------------------------- main


# ---------------------------------------------------------------- machine


def _machine(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from hostir import machine

    if not torch.cuda.is_available():
        model = machine.CPU_MODEL
        where = "the CPU model (no CUDA device)"
    else:
        device = torch.device("cuda", args.device)
        if args.measure:
            model = machine.measure(device)
            where = f"measured now, written to {machine.save_model(model, replace=True)}"
        else:
            model = machine.machine_model(device)
            where = f"cached in {machine._model_path(model.device)}"
    data = dataclasses.asdict(model)
    if args.json:
        print(json.dumps({"model": data, "where": where}, indent=2))
        return 0
    print(f"machine model ({where}):")
    for name, value in data.items():
        if name == "host_ms":
            for runner, call, step in value:
                print(f"  host ms, {runner}: {call:g} per call, {step:g} per ring step")
            continue
        print(f"  {name}: {value:.4g}" if isinstance(value, float) else f"  {name}: {value}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hostir", description="hostir: a Host-IR runtime for sharded, stream-parallel tensor programs.")
    sub = top.add_subparsers(dest="command", required=True, metavar="{dump,run,env,machine,plan}")

    dump = sub.add_parser("dump", help="print the host program a script's first fusion lowers to, per rank, without running it",
                          description="Run SCRIPT as one rank up to its first fd.execute, and print the host program "
                                      "that fusion lowers to on that rank (nothing is executed, no process group is made).")
    dump.add_argument("script")
    dump.add_argument("script_args", nargs="*", help="arguments passed to SCRIPT (after --)")
    dump.add_argument("--rank", type=int, default=None, help="the rank to lower for (default 0)")
    dump.add_argument("--world-size", type=int, default=None, help="the number of ranks (default 1)")
    dump.add_argument("--pass", dest="pass_name", default=None, help="print the program after this lowering pass")
    dump.add_argument("--backend", default="gloo", choices=["gloo", "NCCL"], help="the backend the dump names")
    dump.set_defaults(func=_dump)

    run = sub.add_parser("run", help="start a script on N processes with a launcher and a rendezvous",
                         description="Start SCRIPT on N processes: srun inside a Slurm allocation, else mpirun if it "
                                     "is on PATH, else torchrun; HOSTIR_MASTER_ADDR/PORT name a free rendezvous port.")
    run.add_argument("-n", "--nprocs", type=int, default=2)
    run.add_argument("--launcher", default="auto", choices=["auto", "mpirun", "torchrun", "srun"])
    run.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)

    env = sub.add_parser("env", help="what hostir sees: launcher, backend, devices, P2P, extension, versions",
                         description="Print the launcher variables, the process hostir would be, the backend, "
                                     "devices, P2P access between GPUs, whether the extension is built, and versions.")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.set_defaults(func=_env)

    mach = sub.add_parser("machine", help="the machine model the schedule choice uses; --measure times this GPU again",
                          description="Print the machine model (GEMM, copy and collective throughput, the GEMM's "
                                      "slowdown beside traffic, host cost per call and per ring step by runner) "
                                      "that hostir.machine chooses schedules from; with --measure, time this "
                                      "GPU again and replace the cached model.")
    mach.add_argument("--measure", action="store_true", help="time this GPU now and replace the cached model")
    mach.add_argument("--device", type=int, default=0, help="the CUDA device to show or measure (default 0)")
    mach.add_argument("--json", action="store_true", help="print JSON")
    mach.set_defaults(func=_machine)

    plan = sub.add_parser("plan", help="the analyses' command line (python -m hostir.plan), where installed",
                          description="Run `python -m hostir.plan` with the remaining arguments.", add_help=False)
    plan.add_argument("plan_args", nargs=argparse.REMAINDER)
    plan.set_defaults(func=_plan)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        # Everything after `plan` is hostir.plan's, --help included.
        try:
            return _plan(argparse.Namespace(plan_args=argv[1:]))
        except CommandLineError as err:
            sys.exit(str(err))
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CommandLineError as err:
        sys.exit(str(err))
