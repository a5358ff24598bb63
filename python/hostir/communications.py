"""The communications a lowering emits: collectives (`Communication`,
whose `CommunicationType` declares every fact the package reads about it,
its traffic included), point-to-point messages and their coalescing,
transfers between host and device memory, and the `Wait` that completes
each. Part of the IR; `hostir.ir` re-exports it.
"""

from __future__ import annotations

import enum
from typing import Callable

from hostir import backends
from hostir.errors import DefinitionError, DefinitionTypeError
from hostir.exprs import Expr, _op, as_kind
from hostir.kinds import ReductionKind
from hostir.mesh import ParallelType
from hostir.values import Scalar, TensorView


def nbytes(t) -> int:
    """The bytes of tensor `t` (0 for None: a rank that holds none)."""
    return 0 if t is None else t.numel() * t.element_size()


# The traffic of one collective on rank `me`: (bytes sent to each peer,
# bytes received from each peer), from this rank's input and output
# tensors (None where it holds none) and the root of this post.


def _all_pairs_traffic(size):
    def traffic(e, me, root, input, out):
        each = size(e, input, out)
        others = [p for p in e.team if p != me]
        return {p: each for p in others}, {p: each for p in others}

    return traffic


def _broadcast_traffic(e, me, root, input, out):
    size = nbytes(out) if out is not None else nbytes(input)
    if me == root:
        return {p: size for p in e.team if p != me}, {}
    return {}, {root: size}


def _gather_traffic(e, me, root, input, out):
    senders = [p for p in e.team if p in e.input.mesh]
    if me == root:
        piece = nbytes(out) // max(len(senders), 1)
        return {}, {p: piece for p in senders if p != me}
    return ({root: nbytes(input)} if input is not None else {}), {}


def _scatter_traffic(e, me, root, input, out):
    receivers = [p for p in e.team if p in e.out.mesh]
    if me == root:
        piece = nbytes(input) // max(len(e.out.mesh.devices), 1)
        return {p: piece for p in receivers if p != me}, {}
    return {}, ({root: nbytes(out)} if out is not None else {})


def _reduce_traffic(e, me, root, input, out):
    if me == root:
        return {}, {p: nbytes(out) for p in e.team if p != me}
    # Sent in the output's dtype (a sum of integers is int64).
    piece = input.numel() * e.out.dtype.itemsize
    for d in e.local_reduce:
        piece //= max(input.shape[d], 1)
    return {root: piece}, {}


def _send_recv_traffic(e, me, root, input, out):
    sender, receiver = root, (e.team[-1] if len(e.team) > 1 else e.team[0])
    if sender == receiver:
        return {}, {}
    if me == sender:
        return {receiver: nbytes(input)}, {}
    if me == receiver:
        return {}, {sender: nbytes(out)}
    return {}, {}


def _all_to_all_traffic(e, me, root, input, out):
    # Each rank keeps its own piece and trades one with every other.
    n = max(len(e.team), 1)
    others = [p for p in e.team if p != me]
    return {p: nbytes(input) // n for p in others}, {p: nbytes(out) // n for p in others}


class CommunicationType(enum.Enum):
    """A collective's kind, with every fact the package reads about it:
    `has_root` (it names a root), `reduces` (it takes a `red_op`), who
    sends (`sends`: "all" the team, or the "root") and who receives
    (`receives`: "all", the "root", or "others" than the root), `in_cpp`
    (the C++ core has a path for it; the opcode order is the declaration
    order), and `traffic(e, me, root, input, out)`: the bytes rank `me`
    sends to and receives from each peer, as dicts."""

    has_root: bool
    reduces: bool
    sends: str
    receives: str
    in_cpp: bool
    traffic: Callable

    def __new__(cls, value: str, has_root: bool, reduces: bool, sends: str, receives: str, in_cpp: bool, traffic):
        member = object.__new__(cls)
        member._value_ = value
        member.has_root = has_root
        member.reduces = reduces
        member.sends = sends
        member.receives = receives
        member.in_cpp = in_cpp
        member.traffic = traffic
        return member

    Allgather = "Allgather", False, False, "all", "all", True, _all_pairs_traffic(lambda e, i, o: nbytes(i))
    Allreduce = "Allreduce", False, True, "all", "all", True, _all_pairs_traffic(lambda e, i, o: nbytes(o))
    ReduceScatter = "ReduceScatter", False, True, "all", "all", True, _all_pairs_traffic(lambda e, i, o: nbytes(o))
    Broadcast = "Broadcast", True, False, "root", "others", True, _broadcast_traffic
    Gather = "Gather", True, False, "all", "root", True, _gather_traffic
    Scatter = "Scatter", True, False, "root", "all", True, _scatter_traffic
    Reduce = "Reduce", True, True, "all", "root", True, _reduce_traffic
    SendRecv = "SendRecv", True, False, "root", "others", True, _send_recv_traffic
    AllToAll = "AllToAll", False, False, "all", "all", True, _all_to_all_traffic


# The backends' spellings are declared in `hostir.backends`.
BACKENDS = backends.NAMES
backend_name = backends.backend_name


@_op
class Communication(Expr):
    """A collective over `team` (global ranks) that moves `input` (this
    rank's local piece) into `out`. Posting it does not block the host: it
    is enqueued after the work already on the current stream (NCCL) or runs
    in the background (gloo), and its `Wait` makes the current stream (NCCL)
    or the host (gloo) wait for it. A rank outside `team` does nothing; a
    rank outside `input`'s mesh sends nothing of its own, one outside
    `out`'s mesh keeps nothing. `root` is a global rank (Broadcast, Gather, Scatter,
    Reduce; the sender of SendRecv), or a Scalar evaluated at each post (a
    decomposition's loop names the root by its index); `red_op` is sum, max
    or min."""

    EFFECT = "communication"

    name: int
    type: CommunicationType
    out: TensorView
    input: TensorView
    team: tuple
    root: int | Scalar | None = None
    red_op: ReductionKind | None = None
    backend: str = "NCCL"
    # Dims of the input's local tensor that each rank reduces itself first
    # (the rows of a split mesh_x axis that a rank holds).
    local_reduce: tuple = ()
    # The mesh dimension the team slices: mesh_x (rows) or mesh_y (columns).
    parallel_type: ParallelType = ParallelType.mesh_x
    # The schedule that chose this collective, when a decomposition did (dump only).
    schedule: str | None = None
    # An AllToAll sized at run time (`ir.Set`'s `rows`): this rank's pieces'
    # real rows, of those it sends (`rows`) and receives (`rows_in`); the
    # tensors' own sizes are the bound.
    rows: TensorView | None = None
    rows_in: TensorView | None = None
    INPUTS = ("input", "rows", "rows_in")
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.backend = backend_name(self.backend)
        if self.red_op is not None:
            self.red_op = as_kind(ReductionKind, self.red_op, "reduction")
        if not self.team:
            raise DefinitionError("a Communication needs a non-empty team")
        if self.type.has_root != (self.root is not None):
            raise DefinitionError(f"root {self.root} is not expected by {self.type.value}")
        if isinstance(self.root, int) and self.root not in self.team:
            raise DefinitionError(f"root {self.root} is not in team {self.team}")
        if self.type.reduces != (self.red_op is not None):
            raise DefinitionError(f"{self.type.value} {'needs' if self.type.reduces else 'takes no'} red_op")
        if (self.rows is None) != (self.rows_in is None):
            raise DefinitionError("a Communication sized at run time needs both rows and rows_in")
        if self.rows is not None and self.type is not CommunicationType.AllToAll:
            raise DefinitionError(f"only an AllToAll is sized at run time, not {self.type.value}")

    def id_pairs(self):
        if self.out.ndim == self.input.ndim:
            yield from zip(self.out.loop_axes(), self.input.loop_axes())


@_op
class P2PCommunication(Expr):
    """Sends `buffer` to, or receives it from, the global rank `peer` (a
    scalar evaluated at run time). Posting does not block the host; a `Wait`
    on it, or on the `EndCoalescing` of its group, completes it. The buffer
    must be bound before (a recv writes into it). A one-sided transport
    (cuda) pushes a send into the peer's buffer at `into`: the view of the
    receiver's window that the peer's recv binds, named on the sender."""

    EFFECT = "communication"

    name: int
    type: str  # "send" or "recv"
    buffer: TensorView
    peer: Scalar
    backend: str = "NCCL"
    into: TensorView | None = None
    INPUTS = ("buffer", "peer", "into")

    def __post_init__(self):
        self.backend = backend_name(self.backend)
        if self.type not in ("send", "recv"):
            raise DefinitionError(f"P2PCommunication type must be send or recv, got {self.type!r}")


@_op
class StartCoalescing(Expr):
    """P2P communications posted until the matching `EndCoalescing` are
    grouped and posted together (one NCCL group), so a send and a recv
    between two ranks cannot deadlock each other."""

    EFFECT = "communication"


@_op
class EndCoalescing(Expr):
    """Posts the group opened by `StartCoalescing`; a `Wait` on it completes
    every communication of the group."""

    EFFECT = "communication"

    name: int


@_op
class Transfer(Expr):
    """Copies `input` into `out` between host and device memory (`H2D` or
    `D2H`), posted like a communication: it starts after the work already
    on the current stream, runs on a copy stream of its direction (the copy
    engine; on the CPU it is a plain copy), and its `Wait` completes it. The
    host does not block at the post. `out` must be bound (an `Allocate`).
    `schedule` says where the hoisting pass put it (dump only).

    With `stream="current"` it is no post: the copy runs on the current
    stream, in order with the ops around it, and has no `Wait` (a D2H one
    blocks the host until the bytes are there). `hoist_transfers` makes a
    transfer so where nothing would run between it and its `Wait`: a copy
    stream would then only add a cross-stream wait."""

    EFFECT = "copy"

    name: int
    direction: str  # "H2D" or "D2H"
    out: TensorView
    input: TensorView
    schedule: str | None = None
    stream: str = "copy"  # "copy" (posted, completed by a Wait) or "current"
    INPUTS = ("input",)
    OUTPUTS = ("out",)
    DIRECTIONS = ("H2D", "D2H")
    STREAMS = ("copy", "current")

    def __post_init__(self):
        if self.direction not in self.DIRECTIONS:
            raise DefinitionError(f"a Transfer goes H2D or D2H, got {self.direction!r}")
        if self.stream not in self.STREAMS:
            raise DefinitionError(f"a Transfer runs on the 'copy' or the 'current' stream, got {self.stream!r}")

    @property
    def posted(self) -> bool:
        """Whether it runs on a copy stream and a `Wait` completes it."""
        return self.stream == "copy"

    def id_pairs(self):
        return zip(self.out.loop_axes(), self.input.loop_axes())


@_op
class Wait(Expr):
    """Completes `communication` (a communication or a transfer): on NCCL
    and for a host-to-device transfer the current stream waits for it (the
    host does not block); on gloo and for a device-to-host transfer the host
    waits, with the communicator's timeout for gloo. After it, the output
    buffer holds the result."""

    EFFECT = "sync"

    communication: Expr

    def __post_init__(self):
        if not isinstance(self.communication, (Communication, P2PCommunication, EndCoalescing, Transfer)):
            raise DefinitionTypeError(
                f"Wait takes a Communication, a P2PCommunication, an EndCoalescing or a Transfer, "
                f"got {type(self.communication).__name__}"
            )
        if isinstance(self.communication, Transfer) and not self.communication.posted:
            raise DefinitionError(f"Transfer {self.communication.name} runs on the current stream: it has no Wait")


COMMUNICATION_OPS = (Communication, P2PCommunication, StartCoalescing, EndCoalescing, Wait)
# Ops posted now and completed by a later `Wait`, which a hoisting pass may move.
POSTED_OPS = (Communication, P2PCommunication, Transfer)


def needs_communicator(e: Expr) -> bool:
    """Whether running `e` needs a communicator (a transfer does not)."""
    if isinstance(e, Wait):
        return not isinstance(e.communication, Transfer)
    return isinstance(e, COMMUNICATION_OPS)
