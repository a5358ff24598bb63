"""The examples run under every launcher the README names, quietly: Open MPI's
mpirun, MPICH's mpiexec and torchrun (whose store hostir joins instead of
opening its own); a rank waiting at the rendezvous says for whom."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from launchers import (
    MPIRUN,
    REPO,
    job_env,
    mpich_command,
    mpich_mpiexec,
    open_mpi_command,
    run_job,
    torchrun_command,
)
from spawn import free_port, spawn

EXAMPLE = str(REPO / "examples" / "sequence_parallel_matmul.py")
# Lines a launch must not print: an error line of torch's (a store that
# failed to bind), a warning of any kind.
NOISE = re.compile(r"^\[E|failed to bind|Warning", re.MULTILINE | re.IGNORECASE)


def _check_example(returncode, output, nprocs=2):
    assert returncode == 0, output[-4000:]
    for rank in range(nprocs):
        assert f"rank {rank} of {nprocs}: result" in output, output[-4000:]
    assert "%HostIrContainer {" in output, output[-4000:]
    assert not NOISE.search(output), NOISE.search(output).group(0) + "\n" + output[-4000:]


@pytest.mark.timeout(150)
def test_single_device_example_prints_no_warning():
    returncode, output, _ = run_job([sys.executable, str(REPO / "examples" / "stream_parallel_matmul.py")], 120)
    assert returncode == 0, output[-4000:]
    assert "%HostIrContainer {" in output
    assert not NOISE.search(output), output[-4000:]


@pytest.mark.timeout(150)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH (pip install -e '.[test]')")
def test_example_under_open_mpi():
    command = open_mpi_command(2, [sys.executable, EXAMPLE], {"HOSTIR_MASTER_PORT": str(free_port())})
    _check_example(*run_job(command, 120)[:2])


@pytest.mark.timeout(400)
def test_example_under_mpich():
    command = mpich_command(mpich_mpiexec(), 2, [sys.executable, EXAMPLE], {"HOSTIR_MASTER_PORT": str(free_port())})
    _check_example(*run_job(command, 120)[:2])


@pytest.mark.timeout(150)
def test_example_under_torchrun_joins_the_launchers_store():
    env = job_env()
    env.pop("HOSTIR_MASTER_PORT", None)
    command = torchrun_command(2, free_port(), [EXAMPLE])
    returncode, output, _ = run_job(command, 120, env=env)
    _check_example(returncode, output)


WAITER = textwrap.dedent(
    """
    import os, time
    import torch
    import hostir
    from hostir import communicator, launch
    launch.RENDEZVOUS_LOG_SECONDS = 0.5
    if hostir.rank() == 1:
        time.sleep(3)  # late at the rendezvous
    comm = communicator.get(backend="gloo")
    print(f"rank {comm.rank}: joined", flush=True)
    communicator.shutdown()
    """
)


@pytest.mark.timeout(120)
def test_rank_waiting_at_the_rendezvous_says_for_whom(tmp_path):
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    results = spawn(str(script), 2, env={"HOSTIR_TIMEOUT": "60"}, timeout=90)
    for r in results:
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
        assert f"rank {r.rank}: joined" in r.stdout
    waits = re.findall(r"rank 0 has waited (\d+) s at the rendezvous 127\.0\.0\.1:\d+ for ranks \[1\] of 2", results[0].stderr)
    assert len(waits) >= 2, results[0].stderr
    assert "has waited" not in results[1].stderr, results[1].stderr


LONELY = textwrap.dedent(
    """
    import hostir
    from hostir import communicator
    communicator.get(backend="gloo")
    """
)


@pytest.mark.timeout(120)
def test_rendezvous_timeout_names_the_missing_ranks(tmp_path):
    """Three ranks expected, two started: both name rank 2."""
    script = tmp_path / "lonely.py"
    script.write_text(LONELY)
    results = spawn(str(script), 2, env={"HOSTIR_TIMEOUT": "3", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}, timeout=60)
    for r in results:
        assert r.returncode != 0
        assert re.search(r"LaunchError: rank \d could not complete the rendezvous .* within 3 s: ranks \[2\] of 3 never arrived", r.stderr), r.stderr


@pytest.mark.timeout(120)
def test_rank_that_loses_the_rendezvous_store_names_the_missing_ranks(tmp_path):
    """Rank 0 holds the store and gives up first (a shorter timeout, as when
    it started earlier): rank 1, still waiting, loses the store and says
    which ranks never arrived, not a bare connection error."""
    script = tmp_path / "lonely.py"
    script.write_text(LONELY)
    results = spawn(
        str(script), 2, env={"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"},
        per_rank_env=[{"HOSTIR_TIMEOUT": "2"}, {"HOSTIR_TIMEOUT": "20"}], timeout=60,
    )  # fmt: skip
    assert results[0].returncode != 0
    assert re.search(r"LaunchError: rank 0 could not complete the rendezvous .* within 2 s: ranks \[2\] of 3 never arrived", results[0].stderr), results[0].stderr
    assert results[1].returncode != 0
    assert re.search(
        r"LaunchError: rank 1 could not complete the rendezvous .* within 20 s: ranks \[2\] of 3 never arrived.*"
        r"the rank that holds the rendezvous store closed it after \d",
        results[1].stderr,
    ), results[1].stderr
    assert results[1].elapsed < 15, "rank 1 waited for its own timeout after the store closed"
