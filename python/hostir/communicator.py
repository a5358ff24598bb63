"""Rank discovery and the process groups of the hostir runtime.

`discover()` reads which process this is (rank, world size, local rank) from
explicit arguments or from the variables a launcher exports (torchrun, Open
MPI, MPICH / Intel MPI, Slurm), and turns a partial or contradictory set into
a `LaunchError` that names the variables. `Communicator` builds the
`torch.distributed` state on top of that: the default group over an explicit
rendezvous store, one process group per team of ranks (created by every rank
in one deterministic order), and a gloo control group for metadata agreement
that data collectives never share. Before the first group of a multi-process
job it picks the network interface gloo binds to (`hostir.network`), so ranks
on several nodes reach each other rather than their own loopback. Every group
carries a timeout, and `classify_error` turns the timeouts and lost peers that
gloo reports into `CommunicatorTimeout` and `PeerLostError`, so a rank that
skips a collective or dies ends in an error on the others, never a hang.
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import itertools
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hostir import mailbox, mesh, rendezvous
from hostir.errors import HostIrError
from hostir.network import GLOO_IFNAME, GlooInterface, InterfaceError, choose_gloo_interface
from hostir import log
from hostir.log import logger

__all__ = [
    "LAUNCHER_VARIABLES",
    "Communicator",
    "CommunicatorTimeout",
    "LaunchError",
    "LaunchInfo",
    "PeerLostError",
    "classify_error",
    "discover",
    "get",
    "local_rank",
    "rank",
    "shutdown",
    "world_size",
]

DEFAULT_TIMEOUT = 300.0
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


class LaunchError(HostIrError, RuntimeError):
    """The launcher's environment (or the rendezvous it points to) cannot
    describe a consistent set of processes."""


class CommunicatorTimeout(HostIrError, RuntimeError):
    """A collective did not complete within the communicator's timeout: some
    rank did not join it."""


class PeerLostError(HostIrError, RuntimeError):
    """The connection to a peer closed during a collective: the peer exited."""


class CommunicatorError(HostIrError, RuntimeError):
    """The communicator cannot serve a call: it was shut down, an earlier
    collective failed (the ranks are out of step), another thread is using
    it, or it was asked for with other settings."""


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
        raise LaunchError(
            f"{launcher.rank}={rank} is out of range for {launcher.size}={size} (ranks 0..{size - 1})"
        )
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
        raise LaunchError(
            f"rank={rank} is out of range for world_size={world_size} (ranks 0..{world_size - 1})"
        )
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


def _positive_seconds(value: object, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise CommunicatorArgumentError(f"{name}={value!r} is not a number of seconds") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise CommunicatorArgumentError(f"{name}={value!r} must be a positive, finite number of seconds")
    return seconds


def resolve_timeout(timeout: float | None) -> float:
    """The peer timeout in seconds: `timeout`, else HOSTIR_TIMEOUT, else the
    default; a value that is not a positive number of seconds is an error
    naming where it came from."""
    return _resolve_timeout(timeout)


def _resolve_timeout(timeout: float | None) -> float:
    if timeout is not None:
        return _positive_seconds(timeout, "timeout")
    value = os.environ.get("HOSTIR_TIMEOUT")
    if value is None:
        return DEFAULT_TIMEOUT
    return _positive_seconds(value, "HOSTIR_TIMEOUT")


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


def _choose_interface(addr: str, port: int) -> GlooInterface:
    """Pick gloo's interface (see hostir.network) and export it to this
    process's GLOO_SOCKET_IFNAME, which gloo reads as each group is made."""
    try:
        chosen = choose_gloo_interface(addr, port, os.environ)
    except InterfaceError as exc:
        raise LaunchError(f"{exc}; set it to the interface through which this node reaches the others") from None
    except OSError as exc:
        raise LaunchError(
            f"this node cannot route to the rendezvous address {addr}:{port} ({exc}); set HOSTIR_MASTER_ADDR "
            f"(or MASTER_ADDR) on every rank to an address of rank 0's node that every node reaches"
        ) from exc
    if chosen.name is not None and not os.environ.get(GLOO_IFNAME):
        os.environ[GLOO_IFNAME] = chosen.name
    return chosen


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise CommunicatorArgumentError(f"backend={backend!r}: expected 'nccl' or 'gloo'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise CommunicatorError("backend='nccl' requested but CUDA unavailable; use backend='gloo'")
    return backend


def _resolve_device(backend: str, launch: LaunchInfo) -> torch.device:
    """The rank's device: the CPU under gloo, else GPU `local_rank` of those
    this process sees, or its only one where the launcher gave each rank a
    GPU of its own through CUDA_VISIBLE_DEVICES (`srun --gpus-per-task=1`)."""
    if backend == "gloo":
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if launch.local_rank < gpus:
        return torch.device("cuda", launch.local_rank)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpus == 1 and visible.strip() and "," not in visible:
        return torch.device("cuda", 0)
    processes = f"at least {launch.local_rank + 1}" if launch.local_size is None else launch.local_size
    raise LaunchError(
        f"{processes} processes on this node (local rank {launch.local_rank}) "
        f"but only {gpus} GPUs are visible (CUDA_VISIBLE_DEVICES={visible or 'unset'})"
    )


def shared_gpus(uuids: list[str]) -> dict[str, list[int]]:
    """The GPUs that more than one rank would use: UUID -> ranks, given each
    rank's GPU UUID in rank order."""
    ranks: dict[str, list[int]] = {}
    for rank, uuid in enumerate(uuids):
        ranks.setdefault(uuid, []).append(rank)
    return {uuid: members for uuid, members in ranks.items() if len(members) > 1}


_NEW_GROUP_SORTS = "sort_ranks" in inspect.signature(dist.new_group).parameters
# torch 2.13 renamed the tensor form of all-gather.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _fingerprint(text: str, count: int) -> torch.Tensor:
    """`count` and the SHA-256 of `text` as 5 int64 words."""
    digest = hashlib.sha256(text.encode()).digest()
    words = [count] + [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
    return torch.tensor(words, dtype=torch.int64)

# The process-group backend string: with NCCL, gloo serves the CPU tensors of
# the same group, so metadata and CPU fallbacks need no second group.
_PG_BACKEND = {"nccl": "cpu:gloo,cuda:nccl", "gloo": "gloo"}

_PEER_LOST = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "socket closed",
    "remote process exited",
)
_TIMED_OUT = ("timed out", "timeout")
_GLOO_WAIT = re.compile(r"waiting (\d+)ms")


def classify_error(
    exc: BaseException, what: str, *, rank: int | None = None, timeout: float | None = None
) -> BaseException:
    """Map an error of a collective to `PeerLostError` or `CommunicatorTimeout`
    (with `exc` as `__cause__`), or return `exc` unchanged when it is neither.
    Use as `raise classify_error(exc, "allgather of T3")` in an except block.
    `rank` and `timeout` (seconds) default to what torch.distributed and
    gloo's message say."""
    text = str(exc)
    lowered = text.lower()
    if rank is None and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    where = "" if rank is None else f" on rank {rank}"
    detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if any(pattern in lowered for pattern in _PEER_LOST):
        error: BaseException = PeerLostError(
            f"{what}{where}: the connection to a peer closed, so a peer process probably exited "
            f"or crashed; check the other ranks' output ({detail})"
        )
    elif any(pattern in lowered for pattern in _TIMED_OUT):
        if timeout is None:
            match = _GLOO_WAIT.search(text)
            timeout = int(match.group(1)) / 1000 if match else None
        after = "the configured timeout" if timeout is None else f"{timeout:g} s"
        error = CommunicatorTimeout(
            f"{what} timed out after {after}{where}: some rank did not join it "
            f"(it skipped the call, is stuck, or issues collectives in another order) ({detail})"
        )
    else:
        return exc
    error.__cause__ = exc
    return error


_generation = itertools.count()
# One TCPStore per rendezvous for the life of the process: a re-created
# Communicator must not connect to a server that a slower rank 0 is about to
# close, so the store outlives communicators and each generation gets a fresh
# PrefixStore on it.
_stores: dict[tuple[str, int, int, int], dist.Store] = {}
_live: weakref.WeakSet[Communicator] = weakref.WeakSet()
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
                    raise LaunchError(f"rank {launch.rank}: rank 0 did not complete the rendezvous on {where} within {timeout:g} s")
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


def _rendezvous_error(
    exc: Exception, addr: str, port: int, launch: LaunchInfo, timeout: float
) -> LaunchError:
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


class Communicator:
    """The process groups of one run: the default group, one group per team
    and a gloo control group, all with the same timeout.

    Every rank constructs it, calls `ensure_groups` with the same teams and
    runs the control-group methods in the same order. `shutdown` destroys what
    this object created; a new Communicator may then be made in the process.
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        timeout: float | None = None,
        launch: LaunchInfo | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> None:
        if launch is None:
            launch = _from_default_group() if dist.is_available() and dist.is_initialized() else discover()
        self.launch = launch
        self.backend = _resolve_backend(backend)
        self.timeout = _resolve_timeout(timeout)
        self.master_addr, self.master_port = _resolve_rendezvous(master_addr, master_port, self.launch)
        self.device = _resolve_device(self.backend, self.launch)
        self.rank = self.launch.rank
        self.world_size = self.launch.world_size
        self.local_rank = self.launch.local_rank
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # Each team's group-rank order, asked for at every collective.
        self._orders: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._created: list[dist.ProcessGroup] = []
        self._closed = False
        self._fusion_numbers = itertools.count()
        self._call_numbers = itertools.count()
        # Held by the thread running a multi-device execute: collectives of
        # two calls on the same groups would pair with the wrong peers' calls.
        self.busy = threading.Lock()
        # The first timeout or lost peer of a collective, as text: after it
        # the ranks' collectives are out of step and the executor refuses
        # to post more.
        self.failure: str | None = None
        # Where every rank shares this host: the shared-memory mailbox of the
        # calls' steps (`exchange_step`); else None, and steps go over gloo.
        self.mailbox: mailbox.Mailbox | None = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_default = not dist.is_initialized()
        # The interface this rank's gloo groups bind to; None where the
        # caller made the default group (its groups keep the caller's choice).
        self.interface: GlooInterface | None = None
        if self._owns_default and self.world_size > 1:
            self.interface = _choose_interface(self.master_addr, self.master_port)
        if self._owns_default:
            self._init_default_group()
        else:
            self._check_default_group()
        self._default = dist.group.WORLD
        # A user's default group serves the whole-world team only if it runs
        # our backend; otherwise that team gets a group of its own.
        self._world_is_default = self._owns_default or self.backend in str(dist.get_backend())
        _live.add(self)
        try:
            self._control = self._new_group(None, backend="gloo")
            if self.device.type == "cuda" and self.world_size > 1:
                self._check_gpus_distinct()
            if self.world_size > 1:
                local = self.launch.local_size
                self.mailbox = mailbox.Mailbox.open(
                    self, rendezvous.namespace(rendezvous.job_id()), one_node=local is None or local == self.world_size
                )
            for hook in _creation_hooks:
                hook(self)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "communicator: rank %d of %d (%s), transport %s on %s, timeout %g s, %s, steps over %s",
            self.rank, self.world_size, self.launch.source, self.backend, self.device, self.timeout,
            "default group created" if self._owns_default else "reusing the program's default group",
            "shared memory" if self.mailbox is not None else "the control group",
        )

    def _check_gpus_distinct(self) -> None:
        """Every rank must drive a GPU of its own: NCCL cannot run two ranks
        on one. Local ranks pick the GPUs, so a launch whose local ranks or
        CUDA_VISIBLE_DEVICES repeat on a node would share one; the GPUs'
        UUIDs show it on every rank at once, before any collective."""
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        shared = shared_gpus([u.decode() for u in self.all_gather_bytes(uuid.encode(), 64)])
        if shared:
            groups = "; ".join(f"ranks {', '.join(map(str, ranks))} on GPU {gpu}" for gpu, ranks in shared.items())
            raise LaunchError(
                f"ranks would share a GPU ({groups}): each rank needs its own; check that local ranks "
                f"count from 0 on every node and that CUDA_VISIBLE_DEVICES does not give two ranks one GPU"
            )

    def _init_default_group(self) -> None:
        if self.world_size == 1:
            store: dist.Store = dist.HashStore()
        else:
            # Each job's keys under a namespace of its own (rendezvous.py).
            whole = _tcp_store(self.master_addr, self.master_port, self.launch, self.timeout)
            store = dist.PrefixStore(f"{rendezvous.namespace(rendezvous.job_id())}/{next(_generation)}", whole)
            where = "the torchrun agent's store" if _launcher_store() else f"{self.master_addr}:{self.master_port}"
            _await_ranks(store, self.launch, self.timeout, where, whole)
        dist.init_process_group(
            backend=_PG_BACKEND[self.backend],
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.timeout),
            device_id=self.device if self.backend == "nccl" else None,
        )

    def _check_default_group(self) -> None:
        actual = (dist.get_rank(), dist.get_world_size())
        if actual == (self.rank, self.world_size):
            return
        raise LaunchError(
            f"torch.distributed is already initialized with rank {actual[0]} of {actual[1]}, "
            f"but {self.launch.source} says rank {self.rank} of {self.world_size}"
        )

    def _new_group(self, ranks: list[int] | None, *, backend: str) -> dist.ProcessGroup:
        # Where torch can (sort_ranks, newer than 2.11), a group numbers its
        # members in the team's order; elsewhere in sorted order. Either way
        # `group_order` says which, and the evaluator follows it.
        extra = {"sort_ranks": False} if _NEW_GROUP_SORTS else {}
        group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=self.timeout), backend=backend, **extra)
        self._created.append(group)
        return group

    def _check_open(self) -> None:
        if self._closed:
            raise CommunicatorError("the communicator has been shut down")

    def ensure_groups(self, teams: Iterable[Iterable[int]]) -> None:
        """Create one process group per team not made yet. Collective: every
        rank passes the same teams (checked on the control group first, so a
        mismatch is an error on every rank rather than a hang). Teams are made
        in sorted order; the whole world, in rank order, is the default group.
        A team's group numbers its members in the team's order."""
        self._check_open()
        requested = sorted({tuple(team) for team in teams})
        if self.world_size > 1:
            mine = _fingerprint(repr(requested), len(requested))
            everyone = self.all_gather_words(mine).tolist()
            differing = [r for r, other in enumerate(everyone) if other != everyone[self.rank]]
            if differing:
                raise CommunicatorArgumentError(
                    f"ensure_groups called with different teams across ranks: rank {self.rank} has "
                    f"{len(requested)} teams {requested}, rank {differing[0]} has {everyone[differing[0]][0]} "
                    f"teams, not the same"
                )
        for team in requested:
            self._validate_team(team)
        world = tuple(range(self.world_size))
        for team in requested:
            if team in self._groups:
                continue
            if team == world and self._world_is_default:
                self._groups[team] = dist.group.WORLD
                continue
            self._groups[team] = self._new_group(list(team), backend=_PG_BACKEND[self.backend])

    def missing_teams(self, teams: Iterable[Iterable[int]]) -> list[tuple[int, ...]]:
        """The teams, sorted, that `ensure_groups` has not made yet on this
        rank. Local: ranks must agree on the answer before acting on it."""
        self._check_open()
        return sorted({tuple(team) for team in teams} - self._groups.keys())

    def _validate_team(self, team: tuple) -> None:
        if not team:
            raise CommunicatorArgumentError("team () is empty")
        for member in team:
            if isinstance(member, bool) or not isinstance(member, int):
                raise CommunicatorArgumentError(f"team {team}: member {member!r} is not an integer rank")
            if not 0 <= member < self.world_size:
                raise CommunicatorArgumentError(
                    f"team {team}: rank {member} is out of range for world size {self.world_size}"
                )
        if len(set(team)) != len(team):
            raise CommunicatorArgumentError(f"team {team}: ranks repeat")

    def group(self, team: Iterable[int]) -> dist.ProcessGroup:
        """The process group of a team made by `ensure_groups`; this rank must
        be a member."""
        self._check_open()
        key = tuple(team)
        if key not in self._groups:
            raise CommunicatorError(f"no process group for team {key}: call ensure_groups with it on every rank first")
        if self.rank not in key:
            raise CommunicatorArgumentError(f"rank {self.rank} is not a member of team {key}")
        return self._groups[key]

    def group_order(self, team: Iterable[int]) -> tuple[int, ...]:
        """The global ranks of a team's group in group-rank order: the order
        in which collectives gather and scatter."""
        key = tuple(team)
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = tuple(dist.get_process_group_ranks(self.group(key)))
        return order

    @staticmethod
    def group_rank(team: Iterable[int], global_rank: int) -> int:
        """The index of `global_rank` inside `team`: its rank in the team's
        process group where torch keeps the team's order (see `group_order`)."""
        key = tuple(team)
        if global_rank not in key:
            raise CommunicatorArgumentError(f"rank {global_rank} is not a member of team {key}")
        return key.index(global_rank)

    def all_gather_words(self, words: torch.Tensor) -> torch.Tensor:
        """Every rank's int64 tensor `words` (the same size on every rank),
        stacked in rank order, over the control group: one collective of
        fixed-size tensors, never pickled objects."""
        self._check_open()
        words = words.to(torch.int64).contiguous().view(-1)
        gathered = torch.empty(self.world_size, words.numel(), dtype=torch.int64)
        try:
            _all_gather_tensor(gathered.view(-1), words, group=self._control)
        except Exception as exc:
            raise classify_error(exc, "the ranks' agreement (all-gather)", rank=self.rank, timeout=self.timeout)
        return gathered

    def exchange_step(self, words: list[int]) -> list[list[int]]:
        """Every rank's `words` (a few ints, at most `mailbox.SLOT_WORDS`,
        the same number on every rank), in rank order: through the
        shared-memory mailbox where every rank shares this host, else one
        all-gather on the control group. Collective, in the same order on
        every rank; a rank that does not arrive within the timeout gives
        CommunicatorTimeout (or PeerLostError) naming it."""
        if self.mailbox is not None and not self._closed:
            try:
                return self.mailbox.exchange(words)
            except mailbox.MailboxPeerLost as exc:
                raise PeerLostError(str(exc)) from exc
            except mailbox.MailboxTimeout as exc:
                raise CommunicatorTimeout(str(exc)) from exc
            except mailbox.MailboxError as exc:
                raise CommunicatorError(str(exc)) from exc
        return self.all_gather_words(torch.tensor(words, dtype=torch.int64)).tolist()

    def all_gather_bytes(self, data: bytes, capacity: int) -> list[bytes]:
        """Every rank's `data` (at most `capacity` bytes), in rank order: a
        length word and the bytes padded to `capacity`, gathered as int64
        words with `all_gather_words`, so ranks exchange raw bytes and never
        unpickle a peer's objects."""
        if len(data) > capacity:
            raise CommunicatorArgumentError(f"{len(data)} bytes do not fit the {capacity}-byte record")
        words = -(-capacity // 8)
        padded = bytearray(data.ljust(words * 8, b"\0"))
        record = torch.cat([torch.tensor([len(data)]), torch.frombuffer(padded, dtype=torch.int64)])
        rows = self.all_gather_words(record)
        return [bytes(row[1:].contiguous().view(torch.uint8).tolist())[: int(row[0])] for row in rows]

    def next_fusion_number(self) -> int:
        """A number for a fusion that runs on this communicator for the first
        time: fusions are numbered in the order they first run, the same
        on every rank that runs them in the same order."""
        return next(self._fusion_numbers)

    def next_call_number(self) -> int:
        """The number of a multi-device execute on this communicator (0,
        1, ...): ranks that make the same executes in the same order number
        them alike."""
        return next(self._call_numbers)

    def barrier(self) -> None:
        """Block the host until every rank reaches the barrier (control group)."""
        self._check_open()
        try:
            dist.barrier(group=self._control)
        except Exception as exc:
            raise classify_error(exc, "barrier", rank=self.rank, timeout=self.timeout)

    def shutdown(self) -> None:
        """Destroy the groups this communicator created (the default group
        only if it created it). Local, so it also works after a peer is lost."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        if self.mailbox is not None:
            self.mailbox.close()
        # Drop every reference to the groups, so that destroying them frees
        # them now: freeing a gloo group joins its worker threads, and one
        # still releasing a finished collective's tensors while the
        # interpreter finalizes aborts it ("terminate called without an
        # active exception").
        created, self._created = self._created, []
        default, self._default = self._default, None
        self._control = None
        self._groups.clear()
        self._orders.clear()
        # Destroying the default group destroys every group, so once it is
        # gone (or replaced) there is nothing of ours left to destroy.
        if not dist.is_initialized() or dist.group.WORLD is not default:
            return
        for group in reversed(created):
            dist.destroy_process_group(group)
        if self._owns_default:
            dist.destroy_process_group()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else "live"
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"device={self.device}, timeout={self.timeout:g}, {state})"
        )


# Run by every new communicator, on every rank at the same point of its
# creation (collective code may run there): what a layer above must agree
# on once per communicator (the machine model).
_creation_hooks: list = []


def on_creation(hook) -> None:
    """Call `hook(communicator)` in every communicator's creation, after its
    groups are made; registered once, at import, by the layer that needs it."""
    if hook not in _creation_hooks:
        _creation_hooks.append(hook)


_instance: Communicator | None = None
_instance_lock = threading.Lock()


def get(**kwargs) -> Communicator:
    """The process-wide communicator, created by the first call with `kwargs`
    (Communicator's keyword arguments). A later call with arguments that do not
    match the live one is an error: shut it down first."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = Communicator(**kwargs)
            return _instance
        live = {
            "backend": _instance.backend,
            "timeout": _instance.timeout,
            "launch": _instance.launch,
            "master_addr": _instance.master_addr,
            "master_port": _instance.master_port,
        }
        unknown = set(kwargs) - set(live)
        if unknown:
            raise CommunicatorArgumentError(f"unknown communicator argument(s): {', '.join(sorted(unknown))}")
        differing = {k: v for k, v in kwargs.items() if v is not None and v != live[k]}
        if differing:
            wanted = ", ".join(f"{k}={v!r}" for k, v in differing.items())
            have = ", ".join(f"{k}={live[k]!r}" for k in differing)
            raise CommunicatorError(
                f"a communicator is live with {have}; asked for {wanted}: call shutdown() first"
            )
        return _instance


def live() -> Communicator | None:
    """The process-wide communicator if one is live, else None."""
    with _instance_lock:
        return _instance if _instance is not None and not _instance._closed else None


def shutdown() -> None:
    """Shut the process-wide communicator down; the next get() makes a new one."""
    global _instance
    with _instance_lock:
        if _instance is None:
            return
        _instance.shutdown()
        _instance = None


def _from_default_group() -> LaunchInfo:
    """Which process this is when the program initialized torch.distributed
    itself: the default group's rank and size, with the launcher's local rank
    where its variables agree (else the rank modulo the visible GPUs)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    launch = discover()
    if (launch.rank, launch.world_size) == (rank, size) or launch.world_size > 1:
        # A launcher that disagrees is reported by _check_default_group.
        return launch
    gpus = torch.cuda.device_count()
    return LaunchInfo(rank, size, rank % gpus if gpus else rank, None, "torch.distributed")


def _current() -> LaunchInfo:
    if _instance is not None and not _instance._closed:
        return _instance.launch
    if dist.is_available() and dist.is_initialized():
        return _from_default_group()
    return discover()


def rank() -> int:
    """This process's rank, without initializing a process group."""
    return _current().rank


def world_size() -> int:
    """The number of processes, without initializing a process group."""
    return _current().world_size


log.set_rank_source(lambda: (rank(), world_size()))


def local_rank() -> int:
    """This process's rank on its node, without initializing a process group."""
    return _current().local_rank


def _shutdown_live() -> None:
    # Groups still alive when the interpreter finalizes now and then abort it
    # (see Communicator.shutdown); free them while Python is still whole.
    for communicator in list(_live):
        try:
            communicator.shutdown()
        except Exception:
            pass


# Called at interpreter exit, never by the package itself.
atexit.register(_shutdown_live)


def torch_mesh(devices, shape, device_type: str | None = None):
    """A torch `DeviceMesh` of these ranks in this shape, on `device_type`
    ("cuda" where CUDA is available, else "cpu"). Collective when it needs
    process groups for a part of the world: every rank calls it. If
    `torch.distributed` is not initialized yet, the communicator initializes
    it first (from the launcher's variables)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if not dist.is_initialized():
        # A CPU mesh runs on gloo, on a machine with GPUs too (whose default
        # backend would put the communicator, and the programs, on a GPU).
        if device_type == "cpu":
            get(backend="gloo")
        else:
            get()
    ranks = torch.tensor(list(devices), dtype=torch.int64).reshape(shape)
    return TorchDeviceMesh(device_type or ("cuda" if torch.cuda.is_available() else "cpu"), ranks)


# The IR converts its meshes to torch's through this layer (it imports no
# process code itself).
mesh._torch_mesh = torch_mesh
