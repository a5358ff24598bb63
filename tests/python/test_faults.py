"""Faults on one rank end in errors on every rank, within the timeout.

Two processes with torchrun's variables (tests/python/spawn.py) run a small
worker script written to tmp_path, with HOSTIR_TIMEOUT=5: one rank raises,
exits, passes another shape, or is launched with a partial set of launcher
variables, and each process must exit non-zero (or, for the rank that
exits on purpose, zero) with the error naming what happened, long before
any collective's default timeout. The last case runs the worker under
Open MPI's `mpirun -np 2` and MPICH's `mpiexec -n 2`, each of which must
end the whole job when one rank fails.
"""

from __future__ import annotations

import re
import sys
import textwrap
import time

import pytest

from spawn import free_port, spawn
from launchers import MPIRUN, mpich_command, mpich_mpiexec, open_mpi_command, run_job

TIMEOUT = 5  # HOSTIR_TIMEOUT for every worker
# A failure must show within the timeout, plus process start-up (importing
# torch on a loaded 2-core machine) and the rendezvous.
DEADLINE = TIMEOUT + 30

WORKER = textwrap.dedent(
    r"""
    import os, sys, time
    import torch
    import hostir
    from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor

    mode = sys.argv[1]
    D = 2  # from the test, not hostir.world_size(): a bad launch must fail in execute
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or os.environ.get("RANK", "0"))

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=torch.float32)
        y = fd.ops.set(x)  # x sharded, y replicated: an Allgather
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)

    def run(i, m=3):
        full = torch.arange(D * m, dtype=torch.float32).reshape(D, m)
        out, = fd.execute([shard_tensor(full, x, rank=rank)])
        assert torch.equal(out, full), (out, full)
        print(f"rank {rank}: execute {i} ok", flush=True)

    def fail():
        print(f"rank {rank}: failing at {time.time():.3f}", flush=True)
        raise RuntimeError(f"injected failure on rank {rank}")

    if mode == "raise_before_first_execute":
        if rank == 1:
            fail()
        run(1)
    elif mode == "raise_before_second_execute":
        run(1)
        if rank == 1:
            fail()
        run(2)
    elif mode == "exit_after_two_executes":
        run(1)
        run(2)
        if rank == 1:
            os._exit(0)
        run(3)
    elif mode == "rank_dependent_shape":
        run(1, m=5 if rank == 1 else 3)
    elif mode.startswith("bad_call_on_rank_1:"):
        # Rank 1 alone makes a call that its local checks reject; then every
        # rank makes a good one. Both ranks must fail the first call and pass
        # the second: a rank that failed alone would pair the others' first
        # call with its second.
        bad = mode.split(":", 1)[1]
        m = 3
        full = torch.arange(D * m, dtype=torch.float32).reshape(D, m)
        piece = shard_tensor(full, x, rank=rank)
        call = {
            "number_of_streams": lambda: fd.execute([piece], number_of_streams=0),
            "inputs_not_a_list": lambda: fd.execute(piece),
            "other_timeout": lambda: fd.execute([piece], timeout=2 * float(os.environ["HOSTIR_TIMEOUT"])),
        }[bad]
        run(0)
        try:
            if rank == 1:
                call()
            else:
                fd.execute([piece])
            print(f"rank {rank}: call 1 ok", flush=True)
        except Exception as exc:
            print(f"rank {rank}: call 1 failed: {type(exc).__name__}: {exc}", flush=True)
        run(2)
    elif mode == "execute":
        run(1)
    elif mode == "reduce_split_sharded_axis":
        # x [4, 3] split as [D (mesh_x), 2]; y = sum(x, [0]) on rank 0: a Reduce.
        with FusionDefinition() as fd2:
            a = fd2.define_tensor(shape=[2 * D, 3], dtype=torch.float32)
            b = fd2.ops.sum(a, [0])
            fd2.add_output(b)
        a.set_device_mesh(DeviceMesh(range(D)))
        b.set_device_mesh(DeviceMesh([0]))
        a.outer_split(0, D)
        a.axis(0).parallelize(ParallelType.mesh_x)
        whole = torch.arange(2 * D * 3, dtype=torch.float32).reshape(2 * D, 3)
        try:
            got, = fd2.execute([shard_tensor(whole, a, rank=rank)])
            assert got is None if rank else torch.equal(got, whole.sum(0)), got
            print(f"rank {rank}: reduce ok", flush=True)
        except Exception as exc:
            print(f"rank {rank}: reduce failed: {type(exc).__name__}", flush=True)
            print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        run(2)  # the ranks must still be in step
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(f"rank {rank}: done", flush=True)
    """
)

# Runs the worker after removing the variables named in HOSTIR_TEST_UNSET:
# spawn() can set and override a rank's variables, not remove them.
UNSETTING_LAUNCHER = textwrap.dedent(
    r"""
    import os, runpy, sys
    for name in filter(None, os.environ.pop("HOSTIR_TEST_UNSET", "").split(",")):
        os.environ.pop(name, None)
    worker = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(worker, run_name="__main__")
    """
)

COLLECTIVE_FAILURE = re.compile(r"\b(CommunicatorTimeout|PeerLostError)\b")


def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def run_spawned(tmp_path, mode, per_rank_env=None, unset=None):
    env = {"HOSTIR_TIMEOUT": str(TIMEOUT)}
    script, args = worker(tmp_path), (mode,)
    if unset is not None:
        launcher = tmp_path / "launcher.py"
        launcher.write_text(UNSETTING_LAUNCHER)
        script, args = launcher, (worker(tmp_path), mode)
        per_rank_env = [dict(e or {}, HOSTIR_TEST_UNSET=",".join(u)) for e, u in zip(per_rank_env or [{}, {}], unset)]
    start = time.monotonic()
    results = spawn(str(script), 2, env=env, per_rank_env=per_rank_env, timeout=DEADLINE + 15, args=args)
    wall = time.monotonic() - start
    for r in results:
        assert not r.timed_out, f"rank {r.rank} hung for {r.elapsed:.0f} s:\n{r.stdout}\n{r.stderr}"
    return results, wall


def describe(results) -> str:
    return "\n".join(
        f"--- rank {r.rank}: exit {r.returncode} after {r.elapsed:.1f} s\n{r.stdout}\n{r.stderr[-3000:]}" for r in results
    )


@pytest.mark.timeout(120)
def test_rank_raising_before_its_second_execute_fails_its_peer(tmp_path):
    results, _ = run_spawned(tmp_path, "raise_before_second_execute")
    failing, survivor = results[1], results[0]
    assert failing.returncode != 0, describe(results)
    assert "injected failure on rank 1" in failing.stderr, describe(results)
    assert survivor.returncode != 0, describe(results)
    assert "rank 0: execute 1 ok" in survivor.stdout, describe(results)
    assert COLLECTIVE_FAILURE.search(survivor.stderr), describe(results)
    assert survivor.elapsed < DEADLINE, describe(results)


@pytest.mark.timeout(120)
def test_rank_raising_before_any_execute_fails_its_peer(tmp_path):
    """Rank 1 dies before the first execute, so before the rendezvous: rank 0
    cannot even build the communicator, and says so (a LaunchError naming
    the rendezvous) rather than a collective's error."""
    results, _ = run_spawned(tmp_path, "raise_before_first_execute")
    failing, survivor = results[1], results[0]
    assert failing.returncode != 0, describe(results)
    assert "injected failure on rank 1" in failing.stderr, describe(results)
    assert survivor.returncode != 0, describe(results)
    assert COLLECTIVE_FAILURE.search(survivor.stderr) or re.search(
        r"LaunchError: rank 0 could not complete the rendezvous", survivor.stderr
    ), describe(results)
    assert survivor.elapsed < DEADLINE, describe(results)


@pytest.mark.timeout(120)
def test_rank_exiting_cleanly_mid_run_fails_its_peer(tmp_path):
    results, _ = run_spawned(tmp_path, "exit_after_two_executes")
    survivor, leaver = results[0], results[1]
    assert leaver.returncode == 0, describe(results)
    assert "rank 1: execute 2 ok" in leaver.stdout, describe(results)
    assert survivor.returncode != 0, describe(results)
    assert "rank 0: execute 2 ok" in survivor.stdout and "execute 3 ok" not in survivor.stdout, describe(results)
    assert COLLECTIVE_FAILURE.search(survivor.stderr), describe(results)
    assert survivor.elapsed < DEADLINE, describe(results)


@pytest.mark.timeout(120)
def test_rank_dependent_shape_fails_every_rank(tmp_path):
    results, _ = run_spawned(tmp_path, "rank_dependent_shape")
    for r in results:
        assert r.returncode != 0, describe(results)
        assert "RankMismatchError" in r.stderr, describe(results)
        assert "rank 1" in r.stderr, describe(results)
        assert "[1, 5]" in r.stderr and "[1, 3]" in r.stderr, describe(results)
        assert r.elapsed < DEADLINE, describe(results)


@pytest.mark.timeout(120)
def test_partial_launcher_variables_fail_every_rank(tmp_path):
    """RANK and LOCAL_RANK set, WORLD_SIZE not: every process refuses."""
    results, _ = run_spawned(tmp_path, "execute", unset=[["WORLD_SIZE"], ["WORLD_SIZE"]])
    for r in results:
        assert r.returncode != 0, describe(results)
        assert re.search(r"LaunchError: .*WORLD_SIZE missing", r.stderr), describe(results)
        assert f"RANK='{r.rank}'" in r.stderr, describe(results)
        assert r.elapsed < DEADLINE, describe(results)


@pytest.mark.timeout(120)
def test_partial_launcher_variables_on_one_rank(tmp_path):
    """Only rank 1 lacks WORLD_SIZE: it refuses at once, and rank 0, left
    alone at the rendezvous, gives up within its timeout."""
    results, _ = run_spawned(tmp_path, "execute", unset=[[], ["WORLD_SIZE"]])
    assert re.search(r"LaunchError: .*WORLD_SIZE missing", results[1].stderr), describe(results)
    assert results[1].returncode != 0, describe(results)
    assert results[0].returncode != 0, describe(results)
    assert re.search(r"LaunchError|CommunicatorTimeout|PeerLostError", results[0].stderr), describe(results)
    assert results[0].elapsed < DEADLINE, describe(results)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("openmpi", marks=pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH")),
        "mpich",
    ],
)
@pytest.mark.parametrize("mode", ["raise_before_first_execute", "raise_before_second_execute"])
def test_mpirun_ends_the_job_when_one_rank_raises(tmp_path, mode, launcher):
    exports = {"HOSTIR_TIMEOUT": str(TIMEOUT), "HOSTIR_MASTER_PORT": str(free_port())}
    program = [sys.executable, str(worker(tmp_path)), mode]
    if launcher == "mpich":
        command = mpich_command(mpich_mpiexec(), 2, program, exports)
    else:
        command = open_mpi_command(2, program, exports)
    returncode, output, elapsed = run_job(command, DEADLINE + 60)
    ended = time.time()
    assert returncode is not None, f"{launcher} did not end within {DEADLINE + 60} s:\n{output[-4000:]}"
    assert returncode != 0, output[-4000:]
    assert "injected failure on rank 1" in output, output[-4000:]
    # From the failure, not from the launch: starting two interpreters that
    # import torch takes a loaded 2-core machine anything from 5 to 40 s.
    failed_at = float(re.search(r"rank 1: failing at ([\d.]+)", output).group(1))
    assert ended - failed_at < DEADLINE, f"ended {ended - failed_at:.0f} s after the failure:\n{output[-4000:]}"


@pytest.mark.timeout(120)
def test_reduce_of_split_sharded_axis_onto_one_rank(tmp_path):
    """Each rank reduces its M/D rows, then a Reduce onto rank 0. (A root
    that failed to post its half while the others posted theirs would leave
    them waiting out the timeout, out of step with it.)"""
    results, _ = run_spawned(tmp_path, "reduce_split_sharded_axis")
    for r in results:
        assert r.returncode == 0, describe(results)
        assert f"rank {r.rank}: reduce ok" in r.stdout, describe(results)
        assert f"rank {r.rank}: execute 2 ok" in r.stdout, describe(results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", ["number_of_streams", "inputs_not_a_list", "other_timeout"])
def test_call_rejected_on_one_rank_fails_every_rank(tmp_path, bad):
    results, _ = run_spawned(tmp_path, f"bad_call_on_rank_1:{bad}")
    for r in results:
        assert f"rank {r.rank}: execute 0 ok" in r.stdout, describe(results)
        assert f"rank {r.rank}: call 1 failed" in r.stdout, describe(results)
        assert f"rank {r.rank}: execute 2 ok" in r.stdout, describe(results)
        assert r.returncode == 0, describe(results)
