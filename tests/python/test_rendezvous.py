"""Launch mistakes at the rendezvous end in an error on every process that
names the mistake (rendezvous.py), within the timeout: two processes that
claim one rank, ranks that disagree on the world size, a second job on a
running job's port. And a loopback rendezvous listens on loopback alone."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hostir import communicator, rendezvous
from hostir.communicator import LaunchError, LaunchInfo
from spawn import free_port, spawn

REPO = pathlib.Path(__file__).resolve().parents[2]

# One multi-device execute.
WORKER = textwrap.dedent(
    """
    import os, sys, time
    import torch, hostir
    from hostir import DeviceMesh, FusionDefinition, ParallelType
    # Processes given WORKER_BARRIER=DIR:N wait until N of them are ready,
    # so that they reach the rendezvous together.
    if os.environ.get("WORKER_BARRIER"):
        where, n = os.environ["WORKER_BARRIER"].rsplit(":", 1)
        open(os.path.join(where, str(os.getpid())), "w").close()
        while len(os.listdir(where)) < int(n):
            time.sleep(0.01)
    d = 2
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[d, 4])
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    try:
        fd.execute([torch.ones(1, 4)])
    except hostir.HostIrError as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    print("OK", flush=True)
    """
)


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_two_processes_claiming_one_rank_fail_every_process_naming_it():
    """Two processes claim rank 1 of 2 while rank 0 has not arrived yet
    (threads on one store here, so that the order is fixed): the second
    claimant is refused at once, and the first claimant and rank 0 are told
    which rank was claimed twice, instead of running a job with a stray
    process."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    job = dist.PrefixStore(rendezvous.namespace(""), store)
    where = f"127.0.0.1:{port}"
    errors: dict[str, str] = {}

    def rank(name: str, number: int) -> threading.Thread:
        def run():
            try:
                communicator._await_ranks(job, LaunchInfo(number, 2, number, 2, "test"), 10.0, where, store)
                errors[name] = "completed"
            except LaunchError as e:
                errors[name] = str(e)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    first = rank("first rank 1", 1)
    while not job.check(["arrived/1"]):
        time.sleep(0.01)
    second = rank("second rank 1", 1)
    second.join(10)
    rank0 = rank("rank 0", 0)
    for thread in (first, rank0):
        thread.join(15)
    assert set(errors) == {"first rank 1", "second rank 1", "rank 0"}
    assert errors["second rank 1"].startswith("rank 1 is claimed by 2 processes"), errors
    for name in ("first rank 1", "rank 0"):
        assert "rank 1 is claimed by two processes" in errors[name], errors
    assert errors["first rank 1"].startswith("rank 1: rank 0 refused the rendezvous"), errors


def test_a_second_process_claiming_a_running_jobs_rank_is_refused(worker, tmp_path):
    """Three processes, two of them rank 1, starting together: nothing
    hangs, and every process either runs the job or ends with a
    LaunchError that says what happened (rank 1 claimed twice, or, for a
    process that comes when the job has ended, no rendezvous to reach)."""
    (tmp_path / "barrier").mkdir()
    together = {"WORKER_BARRIER": f"{tmp_path / 'barrier'}:2"}
    results = spawn(
        worker,
        3,
        env={"WORLD_SIZE": "2", "HOSTIR_TIMEOUT": "20"},
        per_rank_env=[{}, together, {"RANK": "1", "LOCAL_RANK": "1", **together}],
        timeout=90,
    )
    report = "\n".join(f"process {r.rank}: {r.returncode} {r.stdout}{r.stderr[-1500:]}" for r in results)
    assert not any(r.timed_out for r in results), report
    said = ("rank 1 is claimed by", "3 processes claim the 2 ranks", "could not reach the rendezvous")
    for r in results:
        if r.returncode != 0:
            assert r.returncode == 3 and "LaunchError" in r.stdout and any(s in r.stdout for s in said), report
    # Two processes cannot both have run as rank 1 of one job.
    assert sum(r.returncode == 0 for r in results[1:]) <= 1, report


def test_ranks_disagreeing_on_the_world_size_both_name_it(worker):
    results = spawn(worker, 2, env={"HOSTIR_TIMEOUT": "30"}, per_rank_env=[{}, {"WORLD_SIZE": "3"}], timeout=90)
    rank0, rank1 = results
    for r in results:
        assert not r.timed_out and r.returncode == 3, r.stdout + r.stderr
    assert "rank 1 has a world size of 3, but this rank (rank 0" in rank0.stdout, rank0.stdout + rank0.stderr
    assert "rank 1 has a world size of 3, but rank 0" in rank1.stdout, rank1.stdout + rank1.stderr


HOLDER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch.distributed as dist
    from hostir import communicator, rendezvous
    # The store of a running job of 2 ranks, as rank 0 holds it.
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=True,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    rendezvous.publish_job(store, 2, "first-job")
    print("LISTENING", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_second_job_on_a_running_jobs_port_is_told_so(tmp_path, worker, rank):
    """Rank 0 of the second job cannot listen there; its other ranks reach
    the first job's store and are refused by the job's name."""
    port = free_port()
    holder = tmp_path / "holder.py"
    holder.write_text(HOLDER)
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    first = subprocess.Popen([sys.executable, str(holder), str(port)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "LISTENING"
        second_env = dict(
            env,
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
            HOSTIR_MASTER_ADDR="127.0.0.1", HOSTIR_MASTER_PORT=str(port), HOSTIR_TIMEOUT="20",
            TORCHELASTIC_RUN_ID="second-job", CUDA_VISIBLE_DEVICES="",
        )  # fmt: skip
        for name in ("PMIX_NAMESPACE", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
            second_env.pop(name, None)
        done = subprocess.run([sys.executable, str(worker)], env=second_env, capture_output=True, text=True, timeout=90)
    finally:
        first.kill()
        first.wait()
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert f"port {port}" in out or f":{port} is held" in out, out
    assert "another job" in out, out
    if rank:
        assert "held by another job (first-job, 2 ranks), not this one (second-job)" in out, out


def test_a_loopback_rendezvous_listens_on_loopback_alone():
    port = free_port()
    sock = rendezvous.loopback_listener("127.0.0.1", port)
    try:
        assert sock is not None and sock.getsockname() == ("127.0.0.1", port)
    finally:
        sock.close()
    assert rendezvous.loopback_listener("192.0.2.1", port) is None  # not loopback: every interface, as torch's store
    assert rendezvous.is_loopback("localhost") and not rendezvous.is_loopback("192.0.2.1")


def test_job_ids_come_from_the_launcher():
    assert rendezvous.job_id({"PMIX_NAMESPACE": "prterun-h-1@1"}) == "prterun-h-1@1"
    assert rendezvous.job_id({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}) == "7.0"
    assert rendezvous.job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "abc"
    assert rendezvous.job_id({}) == ""
    assert rendezvous.namespace("") != rendezvous.namespace("abc")
