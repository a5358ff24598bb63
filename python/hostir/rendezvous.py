"""What the rendezvous store checks before the ranks make their groups.

hostir's rendezvous is a torch `TCPStore` that rank 0 holds (torchrun's
agent store under torchrun). Like torch's, it has no authentication: any
process that reaches the port can read and write it, so jobs belong on
trusted networks. Within that trust model the rendezvous refuses the
launch mistakes it can see, by name, on the ranks that can see them:

- Where it listens: on the rendezvous address alone when that is a loopback
  address (a one-machine job needs no other interface), else on every
  interface, as torch's store does.
- Whose store it is: rank 0 writes a job record (the launcher's job id,
  where it has one, and the world size) next to its keys; every other rank
  reads it first. A rank of another job that reaches the port is told that
  another job holds it; a rank whose world size differs from rank 0's says
  so, and leaves word for rank 0, which says so too.
- Each job's keys live under a namespace of its own (`hostir/<job>/...`).
- Who claims a rank: each process counts its claim in the store; a second
  process claiming a rank is refused, and the ranks still at the rendezvous
  are told which rank was claimed twice. (A process that comes after the
  rendezvous completed is refused alone: the job it would join runs on.)
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

import torch.distributed as dist

from hostir.errors import HostIrError

# Each launcher's name for the job, as every rank of one job sees it.
_JOB_VARIABLES = (
    ("PMIX_NAMESPACE",),  # Open MPI (PRRTE): the job's namespace, e.g. prterun-host-1234@1
    ("SLURM_JOB_ID", "SLURM_STEP_ID"),
    ("TORCHELASTIC_RUN_ID",),
)
_JOB_KEY = "hostir/job"
_WORLD_MISMATCH_KEY = "world-size-mismatch"
_CLAIMS_KEY = "claims"


def job_id(env: Mapping[str, str] = os.environ) -> str:
    """The launcher's id of this job, or "" where it gives none."""
    for names in _JOB_VARIABLES:
        values = [env.get(n, "") for n in names]
        if all(values):
            return ".".join(values)
    return ""


def is_loopback(addr: str) -> bool:
    """Whether `addr` (a name or an address) is a loopback address."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def loopback_listener(addr: str, port: int) -> socket.socket | None:
    """A socket listening on `addr`:`port` alone when `addr` is a loopback
    address (for TCPStore's `master_listen_fd`), else None (the store then
    listens on every interface). An address in use raises OSError."""
    if not is_loopback(addr):
        return None
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def publish_job(store: dist.Store, world_size: int, job: str) -> None:
    """Rank 0: the record other ranks compare themselves with."""
    store.set(_JOB_KEY, f"{job}\n{world_size}")


def namespace(job: str) -> str:
    """The key prefix of one job's rendezvous."""
    return f"hostir/{job or 'job'}"


class Refusal(HostIrError, RuntimeError):
    """A launch mistake the rendezvous saw; the communicator raises it as a
    LaunchError with its message."""


def check_job(store: dist.Store, rank: int, world_size: int, job: str, where: str) -> None:
    """A rank other than 0: refuse a store that another job holds, or whose
    world size differs from this rank's (leaving word for rank 0)."""
    text = store.get(_JOB_KEY).decode()
    their_job, _, their_size = text.partition("\n")
    if their_job and job and their_job != job:
        raise Refusal(
            f"rank {rank}: the rendezvous port at {where} is held by another job ({their_job}, "
            f"{their_size} ranks), not this one ({job}): set HOSTIR_MASTER_PORT to a free port, "
            f"the same on every rank of this job"
        )
    if their_size != str(world_size):
        store.set(f"{namespace(job)}/{_WORLD_MISMATCH_KEY}", f"{rank} {world_size}")
        raise Refusal(
            f"rank {rank} has a world size of {world_size}, but rank 0, which holds the rendezvous at "
            f"{where}, has {their_size}: every rank must have the same world size (WORLD_SIZE or the "
            f"launcher's), or another job holds the port"
        )


def claim_rank(store: dist.Store, rank: int, world_size: int, where: str) -> None:
    """Count this process's claim of `rank` in `store` (one generation's
    keys of the job): first in the job's total of claims, which the waiting
    ranks watch (`check_waiting`), then in the rank's own count. A second
    claim of a rank is refused."""
    store.add(_CLAIMS_KEY, 1)
    claims = store.add(f"claim/{rank}", 1)
    if claims > 1:
        raise Refusal(
            f"rank {rank} is claimed by {claims} processes at the rendezvous {where}: each process needs "
            f"a rank of its own (check RANK or the launcher's variables), or another job holds the port"
        )


def check_waiting(store: dist.Store, whole: dist.Store, job: str, rank: int, world_size: int, where: str) -> None:
    """While a rank waits for the others (`store`: its generation's keys,
    `whole`: the store itself): refuse the launch if more processes than
    ranks claimed a rank or, on rank 0, if a rank reported another world
    size."""
    claims = store.add(_CLAIMS_KEY, 0)
    if claims > world_size:
        twice = [r for r in range(world_size) if store.add(f"claim/{r}", 0) > 1]
        named = f"rank {twice[0]} is claimed by two processes" if twice else f"{claims} processes claim the {world_size} ranks"
        raise Refusal(
            f"rank {rank}: {named} at the rendezvous {where}: each process needs a rank of its own "
            f"(check RANK or the launcher's variables)"
        )
    mismatch = f"{namespace(job)}/{_WORLD_MISMATCH_KEY}"
    if rank == 0 and whole.check([mismatch]):
        other, _, size = whole.get(mismatch).decode().partition(" ")
        raise Refusal(
            f"rank {other} has a world size of {size}, but this rank (rank 0, which holds the rendezvous "
            f"at {where}) has {world_size}: every rank must have the same world size (WORLD_SIZE or the "
            f"launcher's)"
        )
