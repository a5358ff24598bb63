"""The ranks' protocol of multi-device calls: one object per communicator.

Every multi-device `execute` on a communicator of many ranks is one step of
a protocol the ranks run in the same order: each fusion is numbered when it
first runs there, each call of it and each execute on the communicator are
counted, and before a call's first cross-rank effect the ranks check that
they are at the same call of the same fusion, with the program and the
input shapes they agreed on (`runtime/agreement.py` holds the records and
their checks). `Protocol` owns that state and those exchanges, for the full
call path and the prepared (steady) one alike, one per communicator and
team: a fusion whose meshes name a part of the world is agreed on among
those ranks alone (through the rendezvous store), so that two teams (the
tensor-parallel groups of a (dp, tp) mesh) run their fusions side by side:

- the call sequence (`seat`, `next_call`);
- the busy lock: one multi-device call at a time per communicator, a second
  thread is refused (`enter`, `leave`, `held`);
- the failure state: after a collective timed out or lost a peer the ranks'
  collectives are out of step, and every later call is refused (`fail`,
  `refuse_after_failure`);
- full agreement (`agree`, `agree_fully`) and the step of a prepared call
  (`step`).

Calls off the critical path: where the ranks agreed, on a signature's
first call, that none of them posts any communication in its program (each
rank's record says whether its own program does), a prepared call of that
signature exchanges nothing and waits for no rank; so does a later call of
that fusion on the full path (another shape, say) whose program posts no
communication on this rank either. Its step is folded into a chain
(`_pending`) that the next exchanged step carries, so a rank that skipped
or repeated such a call, or made it with other shapes or another program,
or failed it alone, is named on every rank before the next call that
communicates has any cross-rank effect. Its results are its own rank's
alone, right for its inputs whatever the other ranks do; its local error
is raised on its rank only.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from hostir import ir
from hostir.communicator import Communicator, CommunicatorError, CommunicatorTimeout, PeerLostError
from hostir.runtime.agreement import (
    Offer,
    check,
    check_steps,
    everyone_quiet,
    exchange,
    post_steps,
    in_step,
    input_signature,
    token,
)

__all__ = ["Protocol", "Seat", "of", "quiet"]

# 2**63 - 1: the chain of deferred steps stays a positive int64 word.
_MASK = (1 << 63) - 1


class Seat:
    """One fusion's place in a protocol: its number and how many calls it
    made (held by the fusion's executor)."""

    __slots__ = ("protocol", "comm", "fusion", "calls", "quiet")

    def __init__(self, protocol: Protocol, fusion: int):
        self.protocol = protocol
        self.comm = protocol.comm
        self.fusion = fusion
        self.calls = 0
        # The latest full agreement of this fusion found no rank's program
        # communicating.
        self.quiet = False


class _State:
    """What every protocol of one communicator shares: the busy lock and the
    failure state."""

    def __init__(self) -> None:
        # Held by the thread running a multi-device execute: collectives of
        # two calls on the same groups would pair with the wrong peers' calls.
        self.busy = threading.Lock()
        # The first timeout or lost peer of a collective, as text: after it
        # the ranks' collectives are out of step and every call is refused.
        self.failure: str | None = None


class _Among:
    """The exchanges of a team of the world's ranks: through the rendezvous
    store, among the team's members only (`Communicator.gather_among`)."""

    def __init__(self, comm: Communicator, team: tuple[int, ...]):
        self.comm, self.team = comm, team

    def all_gather_words(self, words: torch.Tensor) -> torch.Tensor:
        return self.comm.gather_among(self.team, words)

    def exchange_step(self, words: list[int]) -> list[list[int]]:
        return self.comm.gather_among(self.team, torch.tensor(words, dtype=torch.int64)).tolist()

    def post_step(self, words: list[int]):
        # Through the store, the exchange runs when posted.
        rows = self.exchange_step(words)
        return lambda: rows


class Protocol:
    """The ranks' protocol on one communicator, among the ranks of a team
    (`of(comm, team)`; every rank of the world where `team` is None). The
    ranks of one team number their fusions and calls apart from the
    others', agree among themselves, and make their own process groups:
    two teams run their fusions side by side."""

    def __init__(self, comm: Communicator, team: tuple[int, ...] | None = None, state: _State | None = None):
        self.comm = comm
        self.team = team
        self.size = comm.world_size if team is None else len(team)
        self._state = state if state is not None else _State()
        self.busy = self._state.busy
        self._channel: Any = comm if team is None else _Among(comm, team)
        self._fusions = itertools.count()
        self._calls = itertools.count()
        # Tokens of agreed signatures whose programs post no communication
        # on any rank: their prepared calls exchange nothing.
        self._quiet: set[int] = set()
        # The chain of the steps of such calls since the last exchanged step.
        self._pending = 0

    # -- the call sequence
    def seat(self) -> Seat:
        """A seat for a fusion that runs on this communicator for the first
        time: fusions are numbered in the order they first run, the same
        on every rank that runs them in the same order."""
        return Seat(self, next(self._fusions))

    def next_call(self, seat: Seat) -> tuple[int, int, int]:
        """The fusion's number, the number of this call of it, and the
        number of this call among all multi-device executes here."""
        calls = seat.calls
        seat.calls = calls + 1
        return seat.fusion, calls, next(self._calls)

    # -- the busy lock and the failure state
    def enter(self) -> None:
        """Take the communicator for one call: refused while another thread
        holds it, or after a failed collective."""
        if not self.busy.acquire(blocking=False):
            raise CommunicatorError(
                f"another thread is running a multi-device execute on this process's communicator "
                f"(thread {threading.current_thread().name} was refused): two calls' collectives on the "
                f"same process groups would pair with the wrong calls of the other ranks; run "
                f"multi-device executes from one thread at a time"
            )
        if self.failure is not None:
            self.busy.release()
            self.refuse_after_failure()

    def leave(self) -> None:
        self.busy.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """`enter`, and `leave` at the end of the block."""
        self.enter()
        try:
            yield
        finally:
            self.busy.release()

    def refuse_after_failure(self) -> None:
        """An earlier collective of this rank timed out or lost a peer:
        refuse to post more (the ranks' collectives are out of step)."""
        if self.failure is not None:
            raise CommunicatorError(
                f"an earlier collective failed on this rank, so the ranks' collectives are out of step: "
                f"{self.failure.splitlines()[0]}\nend the job (or call hostir.communicator.shutdown() on "
                f"every rank and start again)"
            )

    @property
    def failure(self) -> str | None:
        """The first timeout or lost peer of a collective on the
        communicator, as text (None before any)."""
        return self._state.failure

    def fail(self, err: BaseException) -> None:
        """Mark the communicator failed by a collective's timeout or lost peer."""
        if self._state.failure is None:
            self._state.failure = f"{type(err).__name__}: {err}"

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """An exchange of the protocol: a timeout or a lost peer marks it
        failed and names the check."""
        try:
            yield
        except (CommunicatorTimeout, PeerLostError) as err:
            self.fail(err)
            raise type(err)(
                f"the ranks' check of the program and its inputs, before running it, failed: {err}"
            ) from err

    # -- agreement
    def agree(
        self,
        seat: Seat,
        sequence: tuple[int, int, int],
        lowered: Any,
        inputs: list,
        error: BaseException | None,
        checking: str = "always",
        lowered_now: bool = False,
    ) -> None:
        """The full path's agreement: the ranks agree on the call, its
        program (`lowered`, a `LoweredProgram`, None where this rank has
        none) and inputs, and any local error, and make the process groups
        the program needs. One rank: its own error is the call's.
        check_ranks="first": only a call that lowered agrees. "always": a
        step comes first, which pairs with the steps of ranks whose call is
        prepared (and carries the chain of quiet calls). A call of a quiet
        fusion whose program posts no communication here waits for no rank
        (its step joins the chain)."""
        comm = self.comm
        teams = lowered.teams if lowered is not None else ()
        if self.size == 1:
            if error is not None:
                raise error
            if comm.missing_teams(teams):
                comm.ensure_groups(teams, among=self.team)
            return
        if checking == "first" and not lowered_now:
            # No agreement: each rank makes the groups it lacks (a
            # collective of its own, which checks the teams).
            if comm.missing_teams(teams):
                comm.ensure_groups(teams, among=self.team)
            return
        if checking == "always" and seat.quiet and (lowered is None or quiet(lowered.program)):
            if lowered is not None and not comm.missing_teams(teams):
                agreed = 0 if error is not None else token(lowered.digest, input_signature(inputs))
                self._pending = _fold(self._pending, sequence, agreed)
                if error is not None:
                    raise error
                return
            if lowered is None and error is not None:
                self._pending = _fold(self._pending, sequence, 0)
                raise error
        steps = None
        if checking not in ("first", "every"):
            steps = self._exchange_steps(sequence, 0)
        self.agree_fully(sequence, lowered, inputs, error, steps, seat)

    def agree_fully(
        self,
        sequence: tuple[int, int, int],
        lowered: Any,
        inputs: list,
        error: BaseException | None,
        steps: list | None = None,
        seat: Seat | None = None,
    ) -> None:
        """The full record: every rank's, checked; then the steps (if the
        call sent one) for what the record does not carry; then the
        process groups any rank lacks. Where no rank's program communicates
        the signature's token is kept as quiet: its prepared calls then
        exchange nothing."""
        comm = self.comm
        teams = lowered.teams if lowered is not None else ()
        signature = input_signature(inputs)
        offer = Offer(
            fusion=sequence[0],
            call=sequence[1],
            digest=lowered.digest if lowered is not None else None,
            inputs=signature,
            error=None if error is None else f"{type(error).__name__}: {error}",
            needs_groups=bool(comm.missing_teams(teams)),
            rank=comm.rank,
            quiet=lowered is not None and quiet(lowered.program),
        )
        with self._control():
            records = exchange(self._channel, offer)
        needs_groups = check(records, cause=error)
        if steps is not None:
            check_steps(steps)
        if needs_groups:
            comm.ensure_groups(teams, among=self.team)
        silent = everyone_quiet(records)
        if seat is not None:
            seat.quiet = silent
        if silent:
            self._quiet.add(token(lowered.digest, signature))

    def step(
        self,
        sequence: tuple[int, int, int],
        agreed: int,
        lowered: Any,
        inputs: list,
        error: BaseException | None,
    ) -> None:
        """A prepared call's check with check_ranks="always" (`agreed`, its
        signature's token): a call of a quiet signature folds its step into
        the chain and returns at once (its own error raised here, on this
        rank); any other exchanges its step (and the chain) and, where
        anything differs on any rank, goes on with every rank to the full
        record, which raises what differs."""
        if agreed in self._quiet:
            self._pending = _fold(self._pending, sequence, agreed if error is None else 0)
            if error is not None:
                raise error
            return
        steps = self._exchange_steps(sequence, 0 if error is not None else agreed)
        if not in_step(steps):
            self.agree_fully(sequence, lowered, inputs, error, steps)

    def post(self, sequence: tuple[int, int, int], agreed: int, lowered: Any, inputs: list) -> PostedStep | None:
        """`step` in two halves, for a runner that holds the call's first
        cross-rank effect until the ranks' steps are collected (the C++
        executor asks the returned `PostedStep` right before its first
        communication): this rank's step is posted now, and the host work
        before that communication (binding, buffers, the rank's own GEMM)
        overlaps the other ranks' arrival. None for a quiet signature,
        whose step is folded into the chain, as `step` does."""
        if agreed in self._quiet:
            self._pending = _fold(self._pending, sequence, agreed)
            return None
        pending, self._pending = self._pending, 0
        with self._control():
            collect = post_steps(self._channel, self.comm.rank, *sequence, agreed, pending)
        return PostedStep(self, sequence, collect, lowered, inputs)

    def _exchange_steps(self, sequence: tuple[int, int, int], agreed: int) -> list:
        pending, self._pending = self._pending, 0
        with self._control():
            return post_steps(self._channel, self.comm.rank, *sequence, agreed, pending)()


class PostedStep:
    """A prepared call's step, posted at the call's start (`Protocol.post`),
    with the call's program and inputs (for the full record). Called, once,
    by the runner right before its first communication, it collects every
    rank's step and says whether they are in step; an error of the collect
    (a timeout, a lost peer: the protocol is marked failed) is kept for
    `settle`, so the runner only stops, before posting anything. The runner
    settles it after the run (`CppEvaluator.run_logical`)."""

    def __init__(self, protocol: Protocol, sequence: tuple[int, int, int], collect, lowered: Any, inputs: list):
        self._protocol, self._sequence, self._collect = protocol, sequence, collect
        self._lowered, self._inputs = lowered, inputs
        self.collected = False
        self.steps: list | None = None
        self.error: BaseException | None = None

    def __call__(self) -> bool:
        if not self.collected:
            self.collected = True
            try:
                with self._protocol._control():
                    self.steps = self._collect()
            except BaseException as err:  # noqa: BLE001 - kept for settle; the runner only stops
                self.error = err
        return self.error is None and in_step(self.steps)

    def settle(self) -> None:
        """After the run, stopped or not: the steps collected if the run
        never reached a communication; a collect's error raised; where the
        ranks are out of step, every rank goes on to the full record, which
        raises what differs (and returns where it all agrees after all:
        a stopped run then runs again)."""
        if self():
            return
        if self.error is not None:
            raise self.error
        self._protocol.agree_fully(self._sequence, self._lowered, self._inputs, None, self.steps)


def _fold(chain: int, sequence: tuple[int, int, int], agreed: int) -> int:
    """The chain with one more deferred step (deterministic on every rank:
    no salted hash)."""
    for word in (*sequence, agreed):
        chain = ((chain ^ word) * 0x100000001B3 + 0x9E3779B97F4A7C15) & _MASK
    return chain or 1


def quiet(program: Any) -> bool:
    """Whether a rank's program posts no communication (no collective, no
    P2P, no coalescing, no wait on one)."""
    return not any(isinstance(e, ir.COMMUNICATION_OPS) for e in program.walk())


_protocols: weakref.WeakKeyDictionary[Communicator, dict] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def of(comm: Communicator, team: tuple[int, ...] | None = None) -> Protocol:
    """The protocol of `comm` among the ranks of `team` (every rank where
    None, or where `team` is the whole world), made on first use; it
    lives as long as the communicator. Every protocol of one communicator
    shares its busy lock and failure state."""
    if team is not None and len(team) == comm.world_size:
        team = None
    found = _protocols.get(comm)
    if found is not None and team in found:
        return found[team]
    with _lock:
        found = _protocols.setdefault(comm, {})
        if team not in found:
            state = found[None]._state if None in found else None
            if team is not None and None not in found:
                found[None] = Protocol(comm)
                state = found[None]._state
            found[team] = Protocol(comm, team, state)
        return found[team]
