"""Run tests/python/multidevice/test_dry_run_vs_gloo.py under mpirun -np 2,
-np 3 and -np 4 with gloo and without TORCH_DISTRIBUTED_DEBUG=DETAIL, whose
checking wrapper allocates tensors of its own around every collective: the
dry run's memory peaks must equal the real runs' here (HOSTIR_EXACT_PEAK=1)."""

from __future__ import annotations

import re
import sys

import pytest

from launchers import job_env, run_job
from spawn import free_port
from multidevice.test_dry_run_vs_gloo import CASES
from test_multidevice_mpirun import mpirun_command, requires_mpirun, summaries

TEST = "tests/python/multidevice/test_dry_run_vs_gloo.py"


@requires_mpirun
@pytest.mark.timeout(330)
@pytest.mark.parametrize("nprocs, limit", [(2, 150), (3, 240), (4, 300)], ids=["np2", "np3", "np4"])
def test_dry_run_against_gloo_under_mpirun(nprocs, limit):
    exports = {
        "HOSTIR_EXACT_PEAK": "1",
        "HOSTIR_TIMEOUT": "30",
        "HOSTIR_MASTER_PORT": str(free_port()),
        "PYTHONPATH": job_env()["PYTHONPATH"],
    }
    program = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", TEST, "--timeout=240"]
    returncode, output, elapsed = run_job(mpirun_command(nprocs, program, exports), limit)
    tail = output[-6000:]
    assert returncode == 0, f"mpirun -np {nprocs} exited with {returncode} after {elapsed:.0f} s:\n{tail}"
    counts = summaries(output)
    assert len(counts) == nprocs, f"expected one pytest summary per rank, got {counts}:\n{tail}"
    for rank_counts in counts:
        assert rank_counts == {"passed": len(CASES)}, f"{counts}\n{tail}"
    assert not re.search(r"^(FAILED|ERROR) ", output, re.MULTILINE), tail
