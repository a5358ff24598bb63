"""Run a script on several local processes the way torchrun would, for tests.

`spawn` gives each process torchrun's variables and a fresh rendezvous port,
captures its output, and kills whatever is still running when the time is up,
so a test of a hang ends in a report rather than a stuck test run.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from hostir.communicator import LAUNCHER_VARIABLES

_PYTHON_DIR = pathlib.Path(__file__).resolve().parents[2] / "python"
# Inherited launcher state (pytest itself may run under mpirun) would
# contradict the variables given to each child.
_STRIPPED = {*LAUNCHER_VARIABLES, "MASTER_ADDR", "MASTER_PORT", "HOSTIR_MASTER_ADDR", "HOSTIR_MASTER_PORT"}
_STRIPPED_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_")


@dataclass
class Result:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    elapsed: float


def free_port() -> int:
    """A TCP port that was free a moment ago (the usual race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _base_env(nprocs: int, port: int) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _STRIPPED and not k.startswith(_STRIPPED_PREFIXES)
    }
    path = [str(_PYTHON_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        HOSTIR_MASTER_ADDR="127.0.0.1",
        HOSTIR_MASTER_PORT=str(port),
        # Ranks run on the CPU with gloo even where there is a GPU: several
        # ranks cannot share one GPU under NCCL.
        CUDA_VISIBLE_DEVICES="",
    )
    return env


def spawn(
    script: str,
    nprocs: int,
    *,
    env: dict | None = None,
    per_rank_env: list[dict] | None = None,
    timeout: float = 60,
    args=(),
) -> list[Result]:
    """Run `python3 script *args` as ranks 0..nprocs-1 and wait at most
    `timeout` seconds in all; a process still running then is killed with its
    process group and reported as timed out."""
    if per_rank_env is not None and len(per_rank_env) != nprocs:
        raise ValueError(f"per_rank_env has {len(per_rank_env)} entries for {nprocs} processes")
    base = _base_env(nprocs, free_port())
    base.update(env or {})
    procs, outputs = [], []
    start = time.monotonic()
    try:
        for rank in range(nprocs):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            rank_env.update(per_rank_env[rank] if per_rank_env else {})
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            outputs.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *map(str, args)],
                    env={k: str(v) for k, v in rank_env.items()},
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        elapsed = _wait(procs, start, timeout)
    finally:
        timed_out = [p.poll() is None for p in procs]
        for proc, late in zip(procs, timed_out):
            if late:
                _kill_group(proc)
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        results.append(
            Result(
                rank=rank,
                returncode=None if timed_out[rank] else proc.returncode,
                stdout=_read(out),
                stderr=_read(err),
                timed_out=timed_out[rank],
                elapsed=elapsed.get(rank, time.monotonic() - start),
            )
        )
    return results


def _wait(procs: list[subprocess.Popen], start: float, timeout: float) -> dict[int, float]:
    elapsed: dict[int, float] = {}
    while len(elapsed) < len(procs) and time.monotonic() - start < timeout:
        for rank, proc in enumerate(procs):
            if rank not in elapsed and proc.poll() is not None:
                elapsed[rank] = time.monotonic() - start
        time.sleep(0.02)
    return elapsed


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read(file) -> str:
    file.seek(0)
    text = file.read().decode(errors="replace")
    file.close()
    return text
