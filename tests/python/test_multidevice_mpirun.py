"""Run tests/python/multidevice under mpirun, from the single-process suite.

The multi-device tests skip themselves in a plain `pytest` run (the world has
one rank); this test launches them with Open MPI's `mpirun -np 2`, `-np 3`
and `-np 4` and MPICH's `mpiexec -n 2` on gloo, each rank running the whole directory
(at `-np 3` without the decompositions, which run alone with `-np 3` and `-np 8`),
and asserts that every rank reports passed tests and no failure. The
launchers and their flags are in `launchers.py`; the rendezvous port is a
free one per launch, passed to every rank as HOSTIR_MASTER_PORT.
"""

from __future__ import annotations

import re
import sys

import pytest

from launchers import MPIRUN, mpich_command, mpich_mpiexec, open_mpi_command, run_job
from spawn import free_port

MULTIDEVICE = "tests/python/multidevice"
requires_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH (pip install -e '.[test]')")


def mpirun_command(nprocs: int, program: list[str], exports: dict[str, str]) -> list[str]:
    """Open MPI's command for `program` on `nprocs` ranks."""
    return open_mpi_command(nprocs, program, exports)


# Not anchored at a line's start: the ranks share one output, and another
# rank's progress dots may come first on the line.
_OUTCOMES = r"(?:passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)"
_SUMMARY = re.compile(rf"(?<!\d)(?P<body>(?:\d+ {_OUTCOMES}(?:, )?)+) in [\d.]+s")


def summaries(output: str) -> list[dict[str, int]]:
    """Each rank's final pytest line (`12 passed, 1 xfailed in 3.1s`) as
    counts, wherever it starts."""
    found = []
    for m in _SUMMARY.finditer(output):
        counts = {}
        for part in m.group("body").split(", "):
            n, word = part.split(" ", 1)
            counts[word] = int(n)
        found.append(counts)
    return found


def _suite(launcher: str, nprocs: int, limit: float, evaluator: str) -> tuple[int | None, str, float]:
    exports = {
        # The C++ run uses `auto`: C++ for every program it can run, Python
        # for the rest (decompositions with chunked views); .ci/run checks
        # that the extension loads.
        "HOSTIR_EVALUATOR": "python" if evaluator == "python" else "auto",
        "HOSTIR_TIMEOUT": "30",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "HOSTIR_MASTER_PORT": str(free_port()),
    }
    program = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", MULTIDEVICE, "--timeout=240"]
    if nprocs == 3:
        program.append(f"--ignore={MULTIDEVICE}/test_decompositions.py")  # test_decompositions_under_mpirun
    if launcher == "mpich":
        command = mpich_command(mpich_mpiexec(), nprocs, program, exports)
    else:
        command = open_mpi_command(nprocs, program, exports)
    return run_job(command, limit)


@pytest.mark.timeout(630)
@pytest.mark.parametrize(
    "launcher, nprocs, limit",
    [
        pytest.param("openmpi", 2, 300, id="np2", marks=requires_mpirun),
        pytest.param("openmpi", 3, 450, id="np3", marks=requires_mpirun),
        pytest.param("openmpi", 4, 600, id="np4", marks=requires_mpirun),
        pytest.param("mpich", 2, 300, id="mpich-np2"),
    ],
)
def test_multidevice_suite_under_mpirun(launcher, nprocs, limit, evaluator):
    """The whole suite on each evaluator: every test checks its results
    against eager torch, so both evaluators agree with it."""
    returncode, output, elapsed = _suite(launcher, nprocs, limit, evaluator)
    tail = output[-6000:]
    assert returncode is not None, f"{launcher} -np {nprocs} did not finish within {limit} s:\n{tail}"
    assert returncode == 0, f"{launcher} -np {nprocs} exited with {returncode} after {elapsed:.0f} s:\n{tail}"
    counts = summaries(output)
    assert len(counts) == nprocs, f"expected one pytest summary per rank, got {counts}:\n{tail}"
    for rank_counts in counts:
        assert rank_counts.get("passed", 0) > 0, f"no passed tests: {counts}\n{tail}"
        bad = {k: v for k, v in rank_counts.items() if k in ("failed", "error", "errors", "xpassed", "skipped")}
        assert not bad, f"{bad} on some rank: {counts}\n{tail}"
    # Every rank ran the same tests with the same outcomes; how many warnings
    # each run raised is its own (a fresh-clone run had 2 on some ranks of 4).
    outcomes = [{k: v for k, v in c.items() if k not in ("warning", "warnings")} for c in counts]
    assert all(o == outcomes[0] for o in outcomes), counts
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
    }
    program = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
        f"{MULTIDEVICE}/test_decompositions.py", "--timeout=480",
    ]  # fmt: skip
    returncode, output, elapsed = run_job(open_mpi_command(nprocs, program, exports), limit)
    tail = output[-6000:]
    assert returncode is not None, f"mpirun -np {nprocs} did not finish within {limit} s:\n{tail}"
    assert returncode == 0, f"mpirun -np {nprocs} exited with {returncode} after {elapsed:.0f} s:\n{tail}"
    counts = summaries(output)
    assert len(counts) == nprocs, f"expected one pytest summary per rank, got {counts}:\n{tail}"
    assert all(c == counts[0] and c.get("passed", 0) > 0 and set(c) == {"passed"} for c in counts), counts
