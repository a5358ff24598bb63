"""Communicator: rank discovery from launcher variables, process groups on
gloo in one process and across spawned ones, and the errors a skipped
collective, a lost peer or a taken port produce instead of a hang."""

from __future__ import annotations

import json
import re
import socket

import pytest
import torch
import torch.distributed as dist

from hostir import communicator
from hostir.communicator import (
    Communicator,
    CommunicatorError,
    CommunicatorTimeout,
    LaunchError,
    LaunchInfo,
    PeerLostError,
    classify_error,
    discover,
)
from spawn import spawn

# --- discover(): precedence --------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"}


def test_no_launcher_is_a_single_process():
    assert discover({}) == LaunchInfo(0, 1, 0, None, "single process")


def test_torchrun_variables():
    assert discover(TORCHRUN) == LaunchInfo(1, 4, 1, 2, "torchrun")


def test_open_mpi_variables():
    assert discover(OPEN_MPI) == LaunchInfo(1, 4, 1, 2, "Open MPI")


def test_mpich_variables():
    assert discover(MPICH) == LaunchInfo(2, 3, 0, 1, "MPICH")


def test_slurm_variables():
    assert discover(SLURM) == LaunchInfo(3, 8, 3, 4, "Slurm")


def test_arguments_beat_the_environment():
    assert discover(TORCHRUN, rank=0, world_size=2, local_rank=1) == LaunchInfo(0, 2, 1, None, "arguments")


def test_local_rank_argument_defaults_to_rank():
    assert discover({}, rank=3, world_size=4).local_rank == 3


def test_torchrun_beats_agreeing_open_mpi():
    assert discover({**OPEN_MPI, **TORCHRUN}).source == "torchrun"


def test_open_mpi_beats_mpich():
    assert discover({**MPICH, **OPEN_MPI}).source == "Open MPI"


def test_mpich_beats_slurm():
    assert discover({**SLURM, **MPICH}).source == "MPICH"


def test_slurm_is_ignored_under_mpirun_in_an_allocation():
    # sbatch exports SLURM_* with the allocation's values into the mpirun step.
    assert discover({**SLURM, **OPEN_MPI}) == LaunchInfo(1, 4, 1, 2, "Open MPI")


def test_slurm_without_tasks_per_node_has_no_local_size():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert discover(env).local_size is None


def test_slurm_nonuniform_tasks_per_node_has_no_local_size():
    assert discover({**SLURM, "SLURM_NTASKS_PER_NODE": "4(x2)"}).local_size is None


def test_mpich_local_rank_falls_back_to_rank():
    assert discover({"PMI_RANK": "2", "PMI_SIZE": "3"}).local_rank == 2


def test_mpich_under_srun_takes_slurms_local_rank_on_every_node():
    # srun --mpi=pmi2, 2 nodes of 4 tasks: rank 6 is the third task of node 1.
    env = {"PMI_RANK": "6", "PMI_SIZE": "8", "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
           "SLURM_NTASKS_PER_NODE": "4"}  # fmt: skip
    assert discover(env) == LaunchInfo(6, 8, 2, 4, "MPICH")


def test_mpich_ignores_slurm_variables_of_another_rank():
    # mpiexec inside an allocation: the step's SLURM_PROCID is not this rank's.
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    assert discover(env).local_rank == 2


def test_mpich_over_several_nodes_without_a_local_rank_is_an_error():
    with pytest.raises(LaunchError, match=r"MPI_LOCALRANKID is missing while MPI_LOCALNRANKS=2 of PMI_SIZE=4"):
        discover({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"})


def test_world_size_one_needs_no_local_rank():
    assert discover({"RANK": "0", "WORLD_SIZE": "1"}) == LaunchInfo(0, 1, 0, None, "torchrun")


# --- discover(): errors ------------------------------------------------------


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0"}, r"WORLD_SIZE missing while RANK='0' set"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"RANK missing while WORLD_SIZE='2', LOCAL_RANK='0' set"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, r"OMPI_COMM_WORLD_SIZE missing while OMPI_COMM_WORLD_RANK='1' set"),
        ({"PMI_SIZE": "2"}, r"PMI_RANK missing"),
        ({"SLURM_PROCID": "0"}, r"SLURM_NTASKS missing while SLURM_PROCID='0' set"),
    ],
)
def test_partial_set_names_missing_and_present_variables(env, message):
    with pytest.raises(LaunchError, match=message):
        discover(env)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "zero", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"RANK='zero' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0.5"}, r"LOCAL_RANK='0.5' is not an integer"),
        ({"PMI_RANK": "0", "PMI_SIZE": ""}, r"PMI_SIZE='' is not an integer"),
    ],
)
def test_non_integer_value_is_named(env, message):
    with pytest.raises(LaunchError, match=message):
        discover(env)


def test_rank_at_world_size_is_out_of_range():
    with pytest.raises(LaunchError, match=r"RANK=2 is out of range for WORLD_SIZE=2"):
        discover({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_negative_rank_is_out_of_range():
    with pytest.raises(LaunchError, match=r"SLURM_PROCID=-1 is out of range for SLURM_NTASKS=2"):
        discover({"SLURM_PROCID": "-1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})


def test_world_size_zero_is_rejected():
    with pytest.raises(LaunchError, match=r"OMPI_COMM_WORLD_SIZE=0 must be at least 1"):
        discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"})


@pytest.mark.parametrize(
    "env, variable",
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "SLURM_LOCALID"),
    ],
)
def test_missing_local_rank_is_an_error_above_one_process(env, variable):
    with pytest.raises(LaunchError, match=rf"{variable} is missing"):
        discover(env)


def test_local_rank_beyond_local_size_is_rejected():
    with pytest.raises(LaunchError, match=r"LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"):
        discover({**TORCHRUN, "LOCAL_RANK": "2"})


def test_torchrun_and_open_mpi_disagreeing_on_rank():
    env = {**TORCHRUN, **OPEN_MPI, "OMPI_COMM_WORLD_RANK": "0"}
    message = r"torchrun and Open MPI disagree: RANK=1, WORLD_SIZE=4 but OMPI_COMM_WORLD_RANK=0"
    with pytest.raises(LaunchError, match=message):
        discover(env)


def test_torchrun_and_mpich_disagreeing_on_world_size():
    env = {**TORCHRUN, "PMI_RANK": "1", "PMI_SIZE": "2"}
    with pytest.raises(LaunchError, match=r"torchrun and MPICH disagree: .* PMI_SIZE=2"):
        discover(env)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 0}, r"pass rank and world_size together \(got rank=0\)"),
        ({"world_size": 2}, r"pass rank and world_size together \(got world_size=2\)"),
        ({"local_rank": 0}, r"pass rank and world_size together \(got local_rank=0\)"),
        ({"rank": 2, "world_size": 2}, r"rank=2 is out of range for world_size=2"),
        ({"rank": 0, "world_size": 0}, r"world_size=0 must be at least 1"),
        ({"rank": "0", "world_size": 2}, r"rank='0' is not an integer"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(LaunchError, match=message):
        discover({}, **kwargs)


# --- classify_error ------------------------------------------------------------

GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 3000ms for recv operation to complete"
)
GLOO_PEER_LOST = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:21384. This is typically caused by a remote worker crashing."
)


def test_gloo_timeout_becomes_communicator_timeout():
    original = RuntimeError(GLOO_TIMEOUT)
    error = classify_error(original, "allgather of T3", rank=1)
    assert isinstance(error, CommunicatorTimeout)
    assert re.search(r"allgather of T3 timed out after 3 s on rank 1", str(error))
    assert error.__cause__ is original


def test_gloo_connection_closed_becomes_peer_lost():
    error = classify_error(RuntimeError(GLOO_PEER_LOST), "barrier", rank=0)
    assert isinstance(error, PeerLostError)
    assert "barrier on rank 0" in str(error)


def test_unrelated_error_is_returned_unchanged():
    original = ValueError("bad shape")
    assert classify_error(original, "allreduce") is original


# --- one process ---------------------------------------------------------------

_OWN_VARIABLES = ("HOSTIR_TIMEOUT", "HOSTIR_MASTER_ADDR", "HOSTIR_MASTER_PORT", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def plain_process(monkeypatch):
    """No launcher variables, and no process group left behind."""
    for name in (*communicator.LAUNCHER_VARIABLES, *_OWN_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    yield
    communicator.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_single_process_runs_a_collective_on_a_one_rank_team(plain_process):
    comm = Communicator()
    try:
        assert (comm.rank, comm.world_size, comm.local_rank) == (0, 1, 0)
        assert comm.backend == ("nccl" if torch.cuda.is_available() else "gloo")
        comm.ensure_groups([(0,)])
        t = torch.arange(3.0, device=comm.device)
        dist.all_reduce(t, group=comm.group((0,)))
        assert t.tolist() == [0.0, 1.0, 2.0]
        assert comm.all_gather_words(torch.tensor([4, -5])).tolist() == [[4, -5]]
        comm.barrier()
    finally:
        comm.shutdown()
    assert not dist.is_initialized()


def test_communicator_is_recreated_after_shutdown(plain_process):
    Communicator(backend="gloo").shutdown()
    comm = Communicator(backend="gloo")
    try:
        assert comm.all_gather_words(torch.tensor([7])).tolist() == [[7]]
    finally:
        comm.shutdown()


def test_methods_after_shutdown_raise(plain_process):
    comm = Communicator(backend="gloo")
    comm.shutdown()
    comm.shutdown()
    with pytest.raises(RuntimeError, match="the communicator has been shut down"):
        comm.all_gather_words(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="the communicator has been shut down"):
        comm.ensure_groups([(0,)])


def test_group_before_ensure_groups_names_the_team(plain_process):
    comm = Communicator(backend="gloo")
    with pytest.raises(CommunicatorError, match=r"team \(0,\): call ensure_groups"):
        comm.group((0,))


@pytest.mark.parametrize(
    "team, message",
    [((0, 1), r"team \(0, 1\): rank 1 is out of range"), ((0, 0), r"team \(0, 0\): ranks repeat")],
)
def test_ensure_groups_rejects_bad_team(plain_process, team, message):
    comm = Communicator(backend="gloo")
    with pytest.raises(ValueError, match=message):
        comm.ensure_groups([team])


def test_missing_teams_lists_teams_not_made_yet(plain_process):
    comm = Communicator(backend="gloo")
    assert comm.missing_teams([(0,), [0]]) == [(0,)]
    comm.ensure_groups([(0,)])
    assert comm.missing_teams([(0,)]) == []


def test_group_rank_is_the_index_in_the_team():
    assert Communicator.group_rank((3, 1, 2), 1) == 1


def test_existing_default_group_is_reused_and_kept(plain_process):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = Communicator(backend="gloo")
    comm.ensure_groups([(0,)])
    assert comm.group((0,)) is dist.group.WORLD
    comm.shutdown()
    assert dist.is_initialized()


def test_existing_default_group_of_another_size_is_an_error(plain_process):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    message = r"already initialized with rank 0 of 1, but arguments says rank 1 of 2"
    with pytest.raises(LaunchError, match=message):
        Communicator(backend="gloo", launch=discover(rank=1, world_size=2))


def test_get_returns_one_live_instance(plain_process):
    comm = communicator.get(backend="gloo", timeout=5)
    assert communicator.get() is comm
    assert communicator.get(timeout=5) is comm
    with pytest.raises(RuntimeError, match=r"live with timeout=5.0; asked for timeout=7"):
        communicator.get(timeout=7)
    communicator.shutdown()
    assert communicator.get(backend="gloo") is not comm


def test_rank_functions_read_the_environment_without_a_process_group(plain_process, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (communicator.rank(), communicator.world_size(), communicator.local_rank()) == (1, 2, 1)
    assert not dist.is_initialized()


def test_bad_timeout_variable_is_named(plain_process, monkeypatch):
    monkeypatch.setenv("HOSTIR_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"HOSTIR_TIMEOUT='soon'"):
        Communicator(backend="gloo")


def test_non_positive_timeout_is_rejected(plain_process):
    with pytest.raises(ValueError, match=r"timeout=0 must be a positive"):
        Communicator(backend="gloo", timeout=0)


def test_unknown_backend_is_rejected(plain_process):
    with pytest.raises(ValueError, match=r"backend='mpi'"):
        Communicator(backend="mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_is_an_error(plain_process):
    with pytest.raises(RuntimeError, match="CUDA unavailable"):
        Communicator(backend="nccl")


# --- which GPU a rank drives ------------------------------------------------------

SECOND_LOCAL_RANK = LaunchInfo(rank=3, world_size=4, local_rank=1, local_size=2, source="torchrun")


def test_local_rank_picks_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert communicator._resolve_device("nccl", SECOND_LOCAL_RANK) == torch.device("cuda", 1)


def test_rank_given_its_own_gpu_by_the_launcher_drives_it(monkeypatch):
    # srun --gpus-per-task=1: local rank 1 sees one GPU, its own.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert communicator._resolve_device("nccl", SECOND_LOCAL_RANK) == torch.device("cuda", 0)


@pytest.mark.parametrize("visible, gpus", [(None, 1), ("0,1", 1), ("0,1", 2)])
def test_too_few_gpus_for_the_local_rank_is_named(monkeypatch, visible, gpus):
    launch = LaunchInfo(rank=2, world_size=4, local_rank=2, local_size=4, source="torchrun")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(LaunchError, match=rf"4 processes on this node \(local rank 2\) but only {gpus} GPUs"):
        communicator._resolve_device("nccl", launch)


def test_gpus_used_by_several_ranks_are_found():
    assert communicator.shared_gpus(["GPU-a", "GPU-b", "GPU-a", "GPU-c", "GPU-b"]) == {
        "GPU-a": [0, 2],
        "GPU-b": [1, 4],
    }
    assert communicator.shared_gpus(["GPU-a", "GPU-b"]) == {}


@pytest.mark.parametrize(
    "env, argument, expected",
    [
        ({}, None, ("127.0.0.1", 29500)),
        ({"MASTER_ADDR": "m", "MASTER_PORT": "1000"}, None, ("m", 1000)),
        ({"MASTER_PORT": "1000", "HOSTIR_MASTER_ADDR": "h", "HOSTIR_MASTER_PORT": "2000"}, None, ("h", 2000)),
        ({"HOSTIR_MASTER_PORT": "2000"}, 3000, ("127.0.0.1", 3000)),
    ],
)
def test_rendezvous_address_precedence(plain_process, monkeypatch, env, argument, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    comm = Communicator(backend="gloo", master_port=argument)
    assert (comm.master_addr, comm.master_port) == expected


def test_bad_port_variable_is_named(plain_process, monkeypatch):
    monkeypatch.setenv("HOSTIR_MASTER_PORT", "http")
    with pytest.raises(ValueError, match=r"HOSTIR_MASTER_PORT='http'"):
        Communicator(backend="gloo")


# --- several processes ---------------------------------------------------------

WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from hostir.communicator import Communicator, CommunicatorTimeout, LaunchError, PeerLostError

mode, timeout = sys.argv[1], float(sys.argv[2])
rank = int(os.environ["RANK"])

def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)

def error_fields(exc, start):
    return dict(error=type(exc).__name__, message=str(exc), cause=repr(exc.__cause__),
                elapsed=time.monotonic() - start)

if mode == "collectives":
    comm = Communicator(backend="gloo", timeout=timeout)
    # Each rank lists the teams in another order; creation order is sorted.
    teams = [(1, 0), (0,), (1,), (0, 1)] if rank == 0 else [(0, 1), (1,), (0,), (1, 0)]
    comm.ensure_groups(teams)
    world = torch.tensor([rank + 1.0])
    dist.all_reduce(world, group=comm.group((0, 1)))
    reversed_team = torch.tensor([10.0 * (rank + 1)])
    dist.all_reduce(reversed_team, group=comm.group((1, 0)))
    alone = torch.tensor([rank + 5.0])
    dist.all_reduce(alone, group=comm.group((rank,)))
    gathered = comm.all_gather_words(torch.tensor([rank, 10 * rank])).tolist()
    reversed_rank = dist.get_rank(comm.group((1, 0)))
    comm.shutdown()
    again = Communicator(backend="gloo", timeout=timeout)
    again.ensure_groups([(0, 1)])
    second = torch.tensor([rank + 1.0])
    dist.all_reduce(second, group=again.group((0, 1)))
    second_gathered = again.all_gather_words(torch.tensor([rank])).tolist()
    again.shutdown()
    report(world=world.item(), reversed_team=reversed_team.item(), alone=alone.item(), gathered=gathered,
           reversed_rank=reversed_rank, group_rank=Communicator.group_rank((1, 0), rank),
           second=second.item(), second_gathered=second_gathered)

elif mode == "skip":
    comm = Communicator(backend="gloo", timeout=timeout)
    comm.barrier()
    if rank == 1:
        time.sleep(timeout + 3)  # alive, but never joins
    else:
        start = time.monotonic()
        try:
            comm.all_gather_words(torch.tensor([rank]))
            report(error=None)
        except Exception as exc:
            report(**error_fields(exc, start))

elif mode == "exit":
    comm = Communicator(backend="gloo", timeout=timeout)
    comm.barrier()
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        comm.all_gather_words(torch.tensor([rank]))
        report(error=None)
    except Exception as exc:
        report(**error_fields(exc, start))

elif mode == "init":
    start = time.monotonic()
    try:
        Communicator(backend="gloo")
        report(error=None)
    except Exception as exc:
        report(**error_fields(exc, start))
"""


def _results(tmp_path, mode, timeout, nprocs=2, **spawn_args):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = spawn(str(script), nprocs, args=(mode, timeout), **spawn_args)
    reports = []
    for r in results:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stdout}\n{r.stderr}"
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        reports.append(json.loads(lines[-1][len("RESULT ") :]) if lines else None)
    return results, reports


@pytest.mark.timeout(120)
def test_two_processes_create_groups_and_reduce(tmp_path):
    results, reports = _results(tmp_path, "collectives", 5)
    for r, report in zip(results, reports):
        assert r.returncode == 0, r.stderr
        assert report["world"] == 3.0
        assert report["reversed_team"] == 30.0
        assert report["alone"] == r.rank + 5.0
        assert report["gathered"] == [[0, 0], [1, 10]]
        assert report["reversed_rank"] == report["group_rank"] == 1 - r.rank
        assert report["second"] == 3.0
        assert report["second_gathered"] == [[0], [1]]


@pytest.mark.timeout(120)
def test_skipped_collective_times_out_instead_of_hanging(tmp_path):
    timeout = 3
    results, reports = _results(tmp_path, "skip", timeout)
    report = reports[0]
    assert report["error"] == "CommunicatorTimeout", report
    assert re.search(rf"agreement \(all-gather\) timed out after {timeout} s on rank 0", report["message"])
    assert "RuntimeError" in report["cause"]
    assert report["elapsed"] < timeout + 20
    # Shutting the timed-out group down at exit keeps the interpreter from aborting.
    assert results[0].returncode == 0, results[0].stderr


@pytest.mark.timeout(120)
def test_exited_peer_ends_the_collective_in_an_error(tmp_path):
    timeout = 3
    results, reports = _results(tmp_path, "exit", timeout)
    assert reports[0]["error"] in ("PeerLostError", "CommunicatorTimeout"), reports[0]
    assert "agreement (all-gather)" in reports[0]["message"]
    assert reports[0]["elapsed"] < timeout + 20


@pytest.mark.timeout(120)
def test_taken_rendezvous_port_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _, reports = _results(
            tmp_path,
            "init",
            0,
            env={"HOSTIR_MASTER_PORT": str(port)},
            per_rank_env=[{"HOSTIR_TIMEOUT": "10"}, {"HOSTIR_TIMEOUT": "2"}],
        )
    assert reports[0]["error"] == "LaunchError", reports[0]
    assert f"port {port}" in reports[0]["message"]
    assert "HOSTIR_MASTER_PORT" in reports[0]["message"]
    # The listener accepts but never answers: rank 1 must still give up.
    assert reports[1]["error"] == "LaunchError", reports[1]
    assert f"127.0.0.1:{port}" in reports[1]["message"]
