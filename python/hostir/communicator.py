"""The process groups of the hostir runtime.

`Communicator` builds the `torch.distributed` state of one run on top of
`hostir.launch` (which process this is, and the rendezvous store where the
ranks meet): the default group over that store, one process group per team
of ranks (created by every rank in one deterministic order), and a gloo
control group for metadata agreement that data collectives never share.
Before the first group of a multi-process job it picks the network interface
gloo binds to (`hostir.network`), so ranks on several nodes reach each other
rather than their own loopback. Every group carries a timeout, and
`classify_error` turns the timeouts and lost peers that gloo reports into
`CommunicatorTimeout` and `PeerLostError`, so a rank that skips a collective
or dies ends in an error on the others, never a hang. The ranks' protocol of
a multi-device call (call numbers, steps, agreement, the failure state) is
`hostir.runtime.protocol`'s, one per communicator.
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import itertools
import math
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from hostir import mailbox, mesh, rendezvous
from hostir.errors import HostIrError
from hostir.launch import (
    LAUNCHER_VARIABLES,
    CommunicatorArgumentError,
    LaunchError,
    LaunchInfo,
    _await_ranks,
    _launcher_store,
    _resolve_rendezvous,
    _tcp_store,
    discover,
)
from hostir.network import GLOO_IFNAME, GlooInterface, InterfaceError, choose_gloo_interface
from hostir import log
from hostir.log import logger

__all__ = [
    "LAUNCHER_VARIABLES",
    "Communicator",
    "CommunicatorArgumentError",
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


class CommunicatorTimeout(HostIrError, RuntimeError):
    """A collective did not complete within the communicator's timeout: some
    rank did not join it."""


class PeerLostError(HostIrError, RuntimeError):
    """The connection to a peer closed during a collective: the peer exited."""


class CommunicatorError(HostIrError, RuntimeError):
    """The communicator cannot serve a call: it was shut down, an earlier
    collective failed (the ranks are out of step), another thread is using
    it, or it was asked for with other settings."""


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
_live: weakref.WeakSet[Communicator] = weakref.WeakSet()

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
        # The rendezvous store of the default group: exchanges among a team
        # of the ranks (`gather_among`) go through it.
        self.store: dist.Store | None = None
        # The count of each team's exchanges (`gather_among`).
        self._team_exchanges: dict[tuple[int, ...], int] = {}
        if self._owns_default:
            self._init_default_group()
        else:
            self._check_default_group()
            self.store = dist.distributed_c10d._get_default_store()
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
        self.store = store
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

    def ensure_groups(self, teams: Iterable[Iterable[int]], among: tuple[int, ...] | None = None) -> None:
        """Create one process group per team not made yet. Collective: every
        rank passes the same teams (checked on the control group first, so a
        mismatch is an error on every rank rather than a hang). Teams are made
        in sorted order; the whole world, in rank order, is the default group.
        A team's group numbers its members in the team's order. With `among`
        (the ranks of a part of the world, every team inside it), only those
        ranks make the groups, and the caller has checked that they pass the
        same teams."""
        self._check_open()
        requested = sorted({tuple(team) for team in teams})
        if among is not None:
            # Only the groups this rank is in: the others' members make them.
            requested = [team for team in requested if self.rank in team]
            for team in requested:
                self._validate_team(team)
                if not set(team) <= set(among):
                    raise CommunicatorArgumentError(f"team {team} is not inside the ranks {among}")
            extra = {"sort_ranks": False} if _NEW_GROUP_SORTS else {}
            for team in requested:
                if team not in self._groups:
                    group = dist.new_group(
                        ranks=list(team), timeout=timedelta(seconds=self.timeout), backend=_PG_BACKEND[self.backend],
                        use_local_synchronization=True, **extra,
                    )  # fmt: skip
                    self._created.append(group)
                    self._groups[team] = group
            return
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
        return self.post_step(words)()

    def post_step(self, words: list[int]) -> Callable[[], list[list[int]]]:
        """`exchange_step` in two halves: post this rank's `words` now, and
        return what collects every rank's (the mailbox's wait, with its
        timeout); nothing else may exchange in between. Without a mailbox
        the all-gather runs here, and the collect returns its rows."""
        if self.mailbox is None or self._closed:
            rows = self.all_gather_words(torch.tensor(words, dtype=torch.int64)).tolist()
            return lambda: rows
        box, n = self.mailbox, len(words)
        k = _from_mailbox(box.post, words)
        return lambda: _from_mailbox(box.collect, k, n)

    def gather_among(self, team: tuple[int, ...], words: torch.Tensor) -> torch.Tensor:
        """Every member's int64 tensor `words` (the same size on each), stacked
        in the team's order, through the rendezvous store: only the team's
        ranks take part, in the same order of calls on each. A member that
        does not post within the timeout gives CommunicatorTimeout naming it."""
        self._check_open()
        if self.store is None:
            raise CommunicatorError("exchanges among a team need the rendezvous store")
        count = self._team_exchanges.get(team, 0)
        self._team_exchanges[team] = count + 1
        prefix = f"hostir-team/{'-'.join(map(str, team))}/"
        data = words.to(torch.int64).contiguous().view(-1).numpy().tobytes()
        keys = [f"{prefix}{count}/{member}" for member in team]
        try:
            self.store.set(f"{prefix}{count}/{self.rank}", data)
            self.store.wait(keys, timedelta(seconds=self.timeout))
            rows = [torch.frombuffer(bytearray(self.store.get(key)), dtype=torch.int64) for key in keys]
            if count:
                # Every member has read the exchange before this one: it
                # posted this one after.
                self.store.delete_key(f"{prefix}{count - 1}/{self.rank}")
        except Exception as exc:
            missing = [member for member, key in zip(team, keys) if not _posted(self.store, key)]
            raise CommunicatorTimeout(
                f"the exchange among ranks {list(team)} on rank {self.rank} did not complete within "
                f"{self.timeout:g} s: ranks {missing} did not post (they skipped the call, are stuck, or exited) "
                f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})"
            ) from exc
        return torch.stack(rows)

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


def _posted(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


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


def _from_mailbox(fn, *args):
    """`fn(*args)` with the mailbox's errors as the communicator's."""
    try:
        return fn(*args)
    except mailbox.MailboxPeerLost as exc:
        raise PeerLostError(str(exc)) from exc
    except mailbox.MailboxTimeout as exc:
        raise CommunicatorTimeout(str(exc)) from exc
    except mailbox.MailboxError as exc:
        raise CommunicatorError(str(exc)) from exc


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
