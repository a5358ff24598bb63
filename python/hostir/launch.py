"""Which process this is, and how the ranks meet.

`discover()` reads which process this is (rank, world size, local rank) from
explicit arguments or from the variables a launcher exports (torchrun, Open
MPI, MPICH / Intel MPI, Slurm), and turns a partial or contradictory set into
a `LaunchError` that names the variables. The rendezvous functions connect a
rank to the job's store (rank 0's `TCPStore`, or torchrun's agent store),
with the checks of `hostir.rendezvous`, and wait, with a timeout that names
the missing ranks, until every rank has arrived. `hostir.communicator` builds
the process groups on top of them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from hostir import rendezvous
from hostir.errors import HostIrError

__all__ = ["LAUNCHER_VARIABLES", "LaunchError", "LaunchInfo", "discover"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


class LaunchError(HostIrError, RuntimeError):
    """The launcher's environment (or the rendezvous it points to) cannot
    describe a consistent set of processes."""


class CommunicatorArgumentError(HostIrError, ValueError):
    """A bad argument for the communicator (backend, timeout, port, team)."""


@dataclass(frozen=True)
class LaunchInfo:
    """Which process this is. `local_size` is None where the launcher does not
    say how many processes share this node."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int | None
    source: str


@dataclass(frozen=True)
class _Launcher:
    source: str
    rank: str
    size: str
    local_rank: str
    local_size: str
    # MPICH's hydra does not always export MPI_LOCALRANKID, nor does srun
    # --mpi=pmi2: see _local_rank_fallback.
    local_rank_defaults_to_rank: bool = False


_TORCHRUN = _Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_OPEN_MPI = _Launcher(
    "Open MPI",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
_MPICH = _Launcher(
    "MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", local_rank_defaults_to_rank=True
)
_SLURM = _Launcher("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
_MPI_LAUNCHERS = (_OPEN_MPI, _MPICH)

# Variables a launcher exports that `discover` reads; test helpers strip them
# so a child process does not inherit its parent's launcher.
LAUNCHER_VARIABLES = tuple(
    name
    for launcher in (_TORCHRUN, _OPEN_MPI, _MPICH, _SLURM)
    for name in (launcher.rank, launcher.size, launcher.local_rank, launcher.local_size)
)


def _int_variable(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _present(env: Mapping[str, str], launcher: _Launcher) -> bool:
    return launcher.rank in env or launcher.size in env


def _read_launcher(env: Mapping[str, str], launcher: _Launcher) -> LaunchInfo:
    """The launcher's set, which must be present: complete and in range."""
    missing = [name for name in (launcher.rank, launcher.size) if name not in env]
    if missing:
        names = (launcher.rank, launcher.size, launcher.local_rank)
        present = [f"{name}={env[name]!r}" for name in names if name in env]
        raise LaunchError(
            f"incomplete {launcher.source} variables: {', '.join(missing)} missing "
            f"while {', '.join(present)} set; set both {launcher.rank} and {launcher.size}, or neither"
        )
    rank = _int_variable(env, launcher.rank)
    size = _int_variable(env, launcher.size)
    local = _int_variable(env, launcher.local_rank)
    local_size = _local_size(env, launcher)
    if size < 1:
        raise LaunchError(f"{launcher.size}={size} must be at least 1")
    if not 0 <= rank < size:
        raise LaunchError(f"{launcher.rank}={rank} is out of range for {launcher.size}={size} (ranks 0..{size - 1})")
    if local is None and launcher.local_rank_defaults_to_rank:
        local, local_size = _local_rank_fallback(env, launcher, rank, size, local_size)
    if local is None and size > 1:
        raise LaunchError(
            f"{launcher.local_rank} is missing ({launcher.rank}={rank}, {launcher.size}={size}); "
            "the local rank picks this process's GPU"
        )
    local = 0 if local is None else local
    if local < 0 or (local_size is not None and local >= local_size):
        bound = "" if local_size is None else f" for {launcher.local_size}={local_size}"
        raise LaunchError(f"{launcher.local_rank}={local} is out of range{bound}")
    return LaunchInfo(rank, size, local, local_size, launcher.source)


def _local_rank_fallback(
    env: Mapping[str, str], launcher: _Launcher, rank: int, size: int, local_size: int | None
) -> tuple[int, int | None]:
    """The local rank (and local size) of an MPICH process without
    MPI_LOCALRANKID. `srun --mpi=pmi2` starts such processes on every node
    of an allocation: Slurm's variables describe the same process when its
    rank matches, and count from 0 on each node. Otherwise the rank stands
    in, which is right only where every rank shares one node."""
    if _int_variable(env, _SLURM.rank) == rank and _SLURM.local_rank in env:
        return _int_variable(env, _SLURM.local_rank), local_size if local_size is not None else _local_size(env, _SLURM)
    if local_size is not None and local_size < size:
        raise LaunchError(
            f"{launcher.local_rank} is missing while {launcher.local_size}={local_size} of "
            f"{launcher.size}={size} says the job spans several nodes, so {launcher.rank}={rank} cannot "
            f"stand in for the local rank; set {launcher.local_rank} (it picks this process's GPU)"
        )
    return rank, local_size


def _local_size(env: Mapping[str, str], launcher: _Launcher) -> int | None:
    # SLURM_NTASKS_PER_NODE is only a plain integer for a uniform
    # --ntasks-per-node; other forms do not name this node's count.
    if launcher is _SLURM:
        value = env.get(launcher.local_size, "").strip()
        return int(value) if value.isdigit() else None
    return _int_variable(env, launcher.local_size)


def _check_agreement(chosen: LaunchInfo, env: Mapping[str, str], launcher: _Launcher) -> None:
    other = _read_launcher(env, launcher)
    if (other.rank, other.world_size) == (chosen.rank, chosen.world_size):
        return
    raise LaunchError(
        f"{chosen.source} and {launcher.source} disagree: "
        f"{_TORCHRUN.rank}={chosen.rank}, {_TORCHRUN.size}={chosen.world_size} but "
        f"{launcher.rank}={other.rank}, {launcher.size}={other.world_size}; "
        f"unset one launcher's variables"
    )


def _from_arguments(rank: int | None, world_size: int | None, local_rank: int | None) -> LaunchInfo:
    if rank is None or world_size is None:
        arguments = (("rank", rank), ("world_size", world_size), ("local_rank", local_rank))
        given = ", ".join(f"{name}={value}" for name, value in arguments if value is not None)
        raise LaunchError(f"pass rank and world_size together (got {given})")
    for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", local_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LaunchError(f"{name}={value!r} is not an integer")
    if world_size < 1:
        raise LaunchError(f"world_size={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise LaunchError(f"rank={rank} is out of range for world_size={world_size} (ranks 0..{world_size - 1})")
    local = rank if local_rank is None else local_rank
    if local < 0:
        raise LaunchError(f"local_rank={local} is negative")
    return LaunchInfo(rank, world_size, local, None, "arguments")


def discover(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
) -> LaunchInfo:
    """Which process this is, without touching torch.distributed.

    Precedence: explicit arguments > torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE) > Open MPI (OMPI_COMM_WORLD_*) > MPICH / Intel MPI
    (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS) > Slurm
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE). With
    nothing set this is the only process. A set counts as present when its rank
    or size variable is; it must then be complete, integer and in range. The
    local rank is required when the world size is above 1, except under MPICH:
    without MPI_LOCALRANKID, Slurm's SLURM_LOCALID serves when Slurm describes
    the same rank (srun --mpi=pmi2), else the rank stands in unless
    MPI_LOCALNRANKS shows the job spans nodes. Complete torchrun and
    MPI sets that disagree on rank or size are an error. Slurm is read only
    when no torchrun or MPI set is present: sbatch exports SLURM_* into every
    step, including an mpirun run inside the allocation.
    """
    if rank is not None or world_size is not None or local_rank is not None:
        return _from_arguments(rank, world_size, local_rank)
    env = os.environ if environ is None else environ
    present = [launcher for launcher in (_TORCHRUN, *_MPI_LAUNCHERS) if _present(env, launcher)]
    if not present:
        if _present(env, _SLURM):
            return _read_launcher(env, _SLURM)
        return LaunchInfo(0, 1, 0, None, "single process")
    chosen = _read_launcher(env, present[0])
    if present[0] is _TORCHRUN:
        for launcher in present[1:]:
            _check_agreement(chosen, env, launcher)
    return chosen


def _resolve_rendezvous(addr: str | None, port: int | None, launch: LaunchInfo) -> tuple[str, int]:
    if addr is None:
        addr = os.environ.get("HOSTIR_MASTER_ADDR") or os.environ.get("MASTER_ADDR")
    if addr is None:
        # The loopback default reaches rank 0 only from rank 0's node: a
        # launch that spans nodes must name rank 0's address.
        if launch.local_size is not None and launch.local_size < launch.world_size:
            raise LaunchError(
                f"{launch.source} places {launch.local_size} of the {launch.world_size} processes on this node, "
                f"so the job spans several nodes, but no rendezvous address is set: set HOSTIR_MASTER_ADDR "
                f"(or MASTER_ADDR) on every rank to an address of rank 0's node that every node reaches"
            )
        addr = DEFAULT_MASTER_ADDR
    if port is not None:
        return addr, _port(port, "master_port")
    for name in ("HOSTIR_MASTER_PORT", "MASTER_PORT"):
        if os.environ.get(name):
            return addr, _port(os.environ[name], name)
    return addr, DEFAULT_MASTER_PORT


def _port(value: object, name: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise CommunicatorArgumentError(f"{name}={value!r} is not a port number") from None
    if not 0 < port < 65536:
        raise CommunicatorArgumentError(f"{name}={value!r} is not a port number (1..65535)")
    return port


# One TCPStore per rendezvous for the life of the process: a re-created
# Communicator must not connect to a server that a slower rank 0 is about to
# close, so the store outlives communicators and each generation gets a fresh
# PrefixStore on it.
_stores: dict[tuple[str, int, int, int], dist.Store] = {}
_listeners: list = []

_log = logging.getLogger("hostir.communicator")
# How often a rank waiting at the rendezvous says so.
RENDEZVOUS_LOG_SECONDS = 10.0


def _launcher_store() -> tuple[str, int, str] | None:
    """The address, port and key prefix of the store a torchrun agent runs
    for its workers (TORCHELASTIC_USE_AGENT_STORE), or None: every rank then
    joins it as a client, as torch's own env:// rendezvous does."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("HOSTIR_MASTER_ADDR") or os.environ.get("HOSTIR_MASTER_PORT"):
        return None  # the user chose a rendezvous of hostir's own
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return addr, _port(port, "MASTER_PORT"), f"/worker/attempt_{attempt}"


def _tcp_store(addr: str, port: int, launch: LaunchInfo, timeout: float) -> dist.Store:
    key = (addr, port, launch.world_size, launch.rank)
    if key in _stores:
        return _stores[key]
    agent = _launcher_store()
    job = rendezvous.job_id()
    try:
        if agent is not None:
            addr, port, prefix = agent
            store: dist.Store = dist.PrefixStore(prefix, _connect(addr, port, launch, timeout, "the torchrun agent"))
        elif launch.rank:
            store = _connect(addr, port, launch, timeout, "rank 0")
            rendezvous.check_job(store, launch.rank, launch.world_size, job, f"{addr}:{port}")
        else:
            store = _listen(addr, port, launch, timeout)
            rendezvous.publish_job(store, launch.world_size, job)
    except rendezvous.Refusal as exc:
        raise LaunchError(str(exc)) from None
    except LaunchError:
        raise
    except Exception as exc:
        raise _rendezvous_error(exc, addr, port, launch, timeout) from exc
    _stores[key] = store
    return store


def _listen(addr: str, port: int, launch: LaunchInfo, timeout: float) -> dist.TCPStore:
    # The other ranks' arrival is awaited in `_await_ranks`, which says
    # whom it waits for.
    # On a loopback rendezvous address the store listens there alone.
    listener = rendezvous.loopback_listener(addr, port)
    store = dist.TCPStore(
        addr, port, launch.world_size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False,
        **({} if listener is None else {"master_listen_fd": listener.fileno()}),
    )  # fmt: skip
    if listener is not None:
        _listeners.append(listener)  # the store serves on its descriptor for the life of the process
    return store


# How often a rank waiting at the rendezvous asks which ranks are missing
# (one store request per rank): every half second up to 64 ranks, less often
# in proportion beyond, so that the store's load stays bounded.
_MISSING_REFRESH_SECONDS = 0.5

# How long past its own timeout a client store may take to answer: it only
# connects and registers, both quick once rank 0 listens.
_CONNECT_GRACE = 5.0


def _connect(addr: str, port: int, launch: LaunchInfo, timeout: float, server: str) -> dist.TCPStore:
    # A client TCPStore whose server accepts the connection but never answers
    # (the port belongs to another program) blocks forever, whatever its
    # timeout; so it connects on a daemon thread that is abandoned if late.
    outcome: dict[str, object] = {}

    def connect() -> None:
        try:
            outcome["store"] = dist.TCPStore(
                addr, port, launch.world_size, is_master=False, timeout=timedelta(seconds=timeout)
            )
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name="hostir-rendezvous", daemon=True)
    thread.start()
    start = time.monotonic()
    limit = timeout + _CONNECT_GRACE
    while thread.is_alive() and time.monotonic() - start < limit:
        thread.join(min(RENDEZVOUS_LOG_SECONDS, limit - (time.monotonic() - start)))
        if thread.is_alive() and time.monotonic() - start < limit:
            _log.warning(
                "rank %d has waited %.0f s at the rendezvous %s:%d for %s to answer",
                launch.rank, time.monotonic() - start, addr, port, server,
            )  # fmt: skip
    if "error" in outcome:
        raise outcome["error"]
    if "store" in outcome:
        return outcome["store"]
    raise LaunchError(
        f"rank {launch.rank} connected to {addr}:{port} but got no rendezvous answer within "
        f"{limit:g} s: another program may hold the port; set HOSTIR_MASTER_PORT "
        f"to a free port (the same on every rank)"
    )


def _await_ranks(
    store: dist.Store, launch: LaunchInfo, timeout: float, where: str, whole: dist.Store | None = None
) -> None:
    """Mark this rank arrived in `store` (a generation's prefix store) and
    wait until every rank has, saying every RENDEZVOUS_LOG_SECONDS whom it
    still waits for; a LaunchError names them after `timeout` seconds.

    The rank that holds the store gives up at its own timeout, which may
    come a little before the others' (it started earlier) and closes the
    store: a rank that loses the store while waiting names the ranks that
    had not arrived when it last looked (it looks every
    _MISSING_REFRESH_SECONDS or so)."""
    job = rendezvous.job_id()
    try:
        rendezvous.claim_rank(store, launch.rank, launch.world_size, where)
    except rendezvous.Refusal as exc:
        raise LaunchError(str(exc)) from None
    store.set(f"arrived/{launch.rank}", "1")
    keys = [f"arrived/{r}" for r in range(launch.world_size)]

    # Rank 0 decides whether the launch is refused, for every rank, so that
    # the ranks at the rendezvous leave it the same way: together, or each
    # with rank 0's refusal (its `verdict`).
    def refused() -> None:
        if launch.rank == 0:
            try:
                rendezvous.check_waiting(store, whole if whole is not None else store, job, 0, launch.world_size, where)
            except rendezvous.Refusal as exc:
                store.set("verdict", str(exc))
                raise LaunchError(str(exc)) from None
        elif store.check(["verdict"]):
            verdict = store.get("verdict").decode()
            if verdict:
                raise LaunchError(f"rank {launch.rank}: rank 0 refused the rendezvous on {where}: {verdict}")

    start = time.monotonic()
    next_log = RENDEZVOUS_LOG_SECONDS
    refresh = _MISSING_REFRESH_SECONDS * max(1.0, launch.world_size / 64)
    next_refresh = refresh
    missing: list[int] | None = None
    pause = 0.001

    def never_arrived() -> str:
        return (
            f"rank {launch.rank} could not complete the rendezvous on {where} within {timeout:g} s: "
            f"ranks {missing} of {launch.world_size} never arrived (did they start, and do they use "
            f"the same HOSTIR_MASTER_ADDR/HOSTIR_MASTER_PORT?)"
        )

    try:
        while not store.check(keys):
            refused()
            waited = time.monotonic() - start
            if waited >= next_refresh or waited >= next_log or waited >= timeout:
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                next_refresh = waited + refresh
            if waited >= timeout:
                raise LaunchError(never_arrived())
            if waited >= next_log:
                _log.warning(
                    "rank %d has waited %.0f s at the rendezvous %s for ranks %s of %d",
                    launch.rank, waited, where, missing, launch.world_size,
                )  # fmt: skip
                next_log += RENDEZVOUS_LOG_SECONDS
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        # Every rank has arrived; before leaving, the ranks wait for each
        # other once more, so that a second process claiming a rank at the
        # same time is seen by all of them, not by itself alone.
        store.add("ready", 1)
        while store.add("ready", 0) < launch.world_size:
            if launch.rank:
                refused()
            if time.monotonic() - start >= timeout:
                raise LaunchError(
                    f"rank {launch.rank}: every rank arrived at the rendezvous on {where}, but not all of them "
                    f"completed it within {timeout:g} s (a rank exited during it?)"
                )
            time.sleep(0.005)
        if launch.rank == 0:
            refused()
            store.set("verdict", "")
        else:
            while not store.check(["verdict"]):
                if time.monotonic() - start >= timeout:
                    raise LaunchError(
                        f"rank {launch.rank}: rank 0 did not complete the rendezvous on {where} within {timeout:g} s"
                    )
                time.sleep(0.005)
            refused()
    except (dist.DistError, RuntimeError) as exc:
        if isinstance(exc, LaunchError):
            raise
        waited = time.monotonic() - start
        if missing is None:
            raise LaunchError(
                f"rank {launch.rank} lost the rendezvous store on {where} after {waited:.1f} s of waiting for "
                f"the other ranks: the rank that holds it exited ({exc})"
            ) from exc
        raise LaunchError(
            f"{never_arrived()}; the rank that holds the rendezvous store closed it after "
            f"{waited:.1f} s of this rank's wait (its own timeout, or it exited)"
        ) from exc


def _rendezvous_error(exc: Exception, addr: str, port: int, launch: LaunchInfo, timeout: float) -> LaunchError:
    text = str(exc)
    if launch.rank == 0 and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        return LaunchError(
            f"rank 0 cannot listen on port {port} for the rendezvous: another job (or program) holds "
            f"the port; set HOSTIR_MASTER_PORT to a free port, the same on every rank ({text})"
        )
    if launch.rank == 0:
        return LaunchError(
            f"rank 0 could not complete the rendezvous on {addr}:{port} within {timeout:g} s "
            f"(not all {launch.world_size} ranks connected; set HOSTIR_MASTER_ADDR/HOSTIR_MASTER_PORT "
            f"if they use another address) ({text})"
        )
    return LaunchError(
        f"rank {launch.rank} could not reach the rendezvous at {addr}:{port} within {timeout:g} s "
        f"(is rank 0 running, and is HOSTIR_MASTER_ADDR/HOSTIR_MASTER_PORT the same on every rank?) ({text})"
    )
