"""What ranks tell each other before a multi-device run, in a fixed binary layout.

Before each run of a multi-device program every rank offers the same record:
which fusion it is running and which call of that fusion this is, the digest
of the program it lowered, its inputs' dtypes and shapes, whether it still
lacks a process group of the program, and the error its local checks raised,
if any. The records are int64 tensors of one fixed size, gathered with one
all-gather on the communicator's gloo control group: no pickle (a peer can
never make this rank unpickle arbitrary data), no numpy, one small
collective. `check` then raises the same `RankMismatchError` on every rank if
any rank failed, is at another call, lowered another program or holds inputs
of other shapes — before any collective of the program.

Layout (version 1; every field an int64 word):

    0       magic and layout version (`MAGIC`)
    1       sender's rank
    2       fusion number (the order in which fusions first ran multi-device)
    3       call number of that fusion on this rank (0, 1, ...)
    4       flags: has program, needs groups, failed, message cut, inputs cut,
            quiet (this rank's program posts no communication)
    5..8    program digest (SHA-256, 32 bytes)
    9..12   inputs digest (SHA-256 of every input's dtype and shape)
    13      number of inputs
    14..    per input, for the first MAX_INPUTS: dtype code, ndim, then
            MAX_DIMS sizes (-1 past ndim; ndim -1 for a value that is not
            a tensor)
    then    message length in bytes, then MESSAGE_BYTES of UTF-8 text

A call whose exact signature the ranks already agreed on (a prepared call,
`runtime/prepared.py`) sends the full record no more. With
`check_ranks="always"` every call of a multi-device program first sends a
*step*: STEP_WORDS int64 words, exchanged through the communicator's
shared-memory mailbox where every rank shares one host (`hostir/mailbox.py`:
a few microseconds), else one all-gather on the same control group —
except a prepared call of a signature whose program posts no communication
on any rank (every record said `quiet`): it sends nothing, and its step is
folded into the chain the next exchanged step carries
(`runtime/protocol.py`) —

    0       magic and layout version (`STEP_MAGIC`)
    1       sender's rank
    2       fusion number
    3       call number of that fusion on this rank
    4       call number on the communicator (every multi-device execute)
    5       the agreed signature's token (`token`): a hash of the program's
            digest and the inputs' dtypes and shapes; 0 for a call that
            takes the full path (a new signature, or a local error)
    6       the chain of the steps of the quiet calls made since the
            last exchanged step (0: none)

If every rank sends the same words 2-6 and no token is 0 (`in_step`), the
ranks are at the same call of the same fusion, with the program and input
shapes they agreed on when that signature first ran: the call runs. Any
difference sends every rank on to the full record (all of them decide it
from the same gathered words), whose `check` names what differs; a
difference the full record cannot see (the communicator's call numbers)
or the chains of quiet calls) is named by `check_steps`. So a steady-state call costs one all-gather of
STEP_WORDS words instead of the full record, its encoding and its decoding,
and the protections are the full record's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, NamedTuple

import torch

from hostir.errors import HostIrError

VERSION = 2
MAGIC = 0x4849_5241_0000_0000 | VERSION  # "HIRA" and the layout version
MAX_INPUTS = 16
MAX_DIMS = 8
MESSAGE_BYTES = 1024

_HAS_PROGRAM, _NEEDS_GROUPS, _FAILED, _MESSAGE_CUT, _INPUTS_CUT, _QUIET = 1, 2, 4, 8, 16, 32
_INPUT_WORDS = 2 + MAX_DIMS
_INPUTS_AT = 14
_MESSAGE_AT = _INPUTS_AT + MAX_INPUTS * _INPUT_WORDS
WORDS = _MESSAGE_AT + 1 + MESSAGE_BYTES // 8

# Codes of the dtypes a record names; any other is OTHER_DTYPE (the inputs
# digest still tells them apart).
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
OTHER_DTYPE = 255


class RankMismatchError(HostIrError, ValueError):
    """Ranks disagree on the call, the program or its inputs, or one rank
    rejected its inputs; raised on every rank, before any collective of the
    program."""


@dataclasses.dataclass
class Offer:
    """One rank's record. `inputs` holds (dtype, shape) per input, or
    (None, None) for a value that is not a tensor."""

    fusion: int
    call: int
    digest: str | None
    inputs: list[tuple[torch.dtype | None, list[int] | None]]
    error: str | None = None
    needs_groups: bool = False
    rank: int = 0
    # This rank's program posts no communication.
    quiet: bool = False


@dataclasses.dataclass
class Record:
    """A decoded record: what `check` compares. Input entries past
    MAX_INPUTS are known only through `inputs_digest`."""

    version: int
    rank: int
    fusion: int
    call: int
    digest: bytes | None
    inputs_digest: bytes
    inputs: list[tuple[int, list[int] | None]]
    inputs_cut: bool
    error: str | None
    needs_groups: bool
    quiet: bool = False


def input_signature(inputs) -> list[tuple[torch.dtype | None, list[int] | None]]:
    """What ranks compare of their inputs: dtype and shape (local pieces have
    the same shape on every rank: shards are even)."""
    if not isinstance(inputs, (list, tuple)):
        return [(None, None)]
    return [(t.dtype, list(t.shape)) if isinstance(t, torch.Tensor) else (None, None) for t in inputs]


def _digest_words(data: bytes) -> list[int]:
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _bytes_of(words: list[int]) -> bytes:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words)


def _inputs_digest(inputs) -> bytes:
    text = ";".join("-" if dtype is None else f"{dtype}{shape}" for dtype, shape in inputs)
    return hashlib.sha256(text.encode()).digest()


def encode(offer: Offer) -> torch.Tensor:
    """`offer` as a tensor of WORDS int64."""
    words = [0] * WORDS
    flags = 0
    words[0], words[1], words[2], words[3] = MAGIC, offer.rank, offer.fusion, offer.call
    if offer.digest is not None:
        flags |= _HAS_PROGRAM
        words[5:9] = _digest_words(bytes.fromhex(offer.digest)[:32].ljust(32, b"\0"))
    if offer.needs_groups:
        flags |= _NEEDS_GROUPS
    if offer.quiet:
        flags |= _QUIET
    words[9:13] = _digest_words(_inputs_digest(offer.inputs))
    words[13] = len(offer.inputs)
    if len(offer.inputs) > MAX_INPUTS:
        flags |= _INPUTS_CUT
    for i, (dtype, shape) in enumerate(offer.inputs[:MAX_INPUTS]):
        at = _INPUTS_AT + i * _INPUT_WORDS
        if dtype is None:
            words[at : at + _INPUT_WORDS] = [OTHER_DTYPE, -1] + [-1] * MAX_DIMS
            continue
        if len(shape) > MAX_DIMS:
            flags |= _INPUTS_CUT
        sizes = shape[:MAX_DIMS]
        words[at] = _DTYPE_CODE.get(dtype, OTHER_DTYPE)
        words[at + 1] = len(shape)
        words[at + 2 : at + 2 + len(sizes)] = sizes
        words[at + 2 + len(sizes) : at + _INPUT_WORDS] = [-1] * (MAX_DIMS - len(sizes))
    if offer.error is not None:
        flags |= _FAILED
        text = offer.error.encode("utf-8", errors="replace")
        if len(text) > MESSAGE_BYTES:
            flags |= _MESSAGE_CUT
            text = text[:MESSAGE_BYTES].decode("utf-8", errors="ignore").encode()
        words[_MESSAGE_AT] = len(text)
        padded = text.ljust(-(-len(text) // 8) * 8, b"\0")
        words[_MESSAGE_AT + 1 : _MESSAGE_AT + 1 + len(padded) // 8] = [
            int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)
        ]
    words[4] = flags
    return torch.tensor(words, dtype=torch.int64)


def decode(words: list[int]) -> Record:
    """A record from the WORDS int64 values of one rank."""
    flags = words[4]
    inputs = []
    for i in range(min(words[13], MAX_INPUTS)):
        at = _INPUTS_AT + i * _INPUT_WORDS
        code, ndim = words[at], words[at + 1]
        inputs.append((code, None if ndim < 0 else words[at + 2 : at + 2 + min(ndim, MAX_DIMS)]))
    error = None
    if flags & _FAILED:
        length = max(0, min(words[_MESSAGE_AT], MESSAGE_BYTES))
        raw = _bytes_of(words[_MESSAGE_AT + 1 : _MESSAGE_AT + 1 + -(-length // 8)])[:length]
        error = raw.decode("utf-8", errors="replace") + (" [...]" if flags & _MESSAGE_CUT else "")
    return Record(
        version=words[0] - (MAGIC - VERSION) if words[0] >> 32 == MAGIC >> 32 else -1,
        rank=words[1],
        fusion=words[2],
        call=words[3],
        digest=_bytes_of(words[5:9]) if flags & _HAS_PROGRAM else None,
        inputs_digest=_bytes_of(words[9:13]),
        inputs=inputs,
        inputs_cut=bool(flags & _INPUTS_CUT) or words[13] > MAX_INPUTS,
        error=error,
        needs_groups=bool(flags & _NEEDS_GROUPS),
        quiet=bool(flags & _QUIET),
    )


def exchange(comm, offer: Offer) -> list[Record]:
    """Every rank's record, in rank order: one all-gather on the control group."""
    rows = comm.all_gather_words(encode(offer)).tolist()
    return [decode(row) for row in rows]


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else "another dtype"


def _describe_input(entry) -> str:
    code, shape = entry
    if shape is None:
        return "a value that is not a tensor"
    return f"shape {shape} and dtype {_dtype_name(code)}"


def _inputs_difference(rec: Record, ref: Record) -> str:
    for i, (a, b) in enumerate(zip(rec.inputs, ref.inputs)):
        if a != b:
            return (
                f"inputs differ across ranks: rank {rec.rank} input {i} has {_describe_input(a)}, "
                f"but rank {ref.rank} input {i} has {_describe_input(b)}"
            )
    return (
        f"inputs differ across ranks: rank {rec.rank}'s inputs differ from rank {ref.rank}'s in number, or "
        f"beyond the first {MAX_INPUTS} inputs or {MAX_DIMS} dims"
    )


def check(records: list[Record], cause: BaseException | None = None) -> bool:
    """Raise `RankMismatchError` unless every rank is at the same call of the
    same fusion, passed its local checks, lowered the same program and holds
    inputs of the same shapes and dtypes; else return whether any rank lacks
    a process group of the program (then all create them together). Where
    every rank failed a check of the same kind, nothing is disagreed on:
    each rank raises its own error (`cause`), as one rank would. The
    records are those of the ranks that run the program (a team of the
    world, or all of it), named by their global ranks."""
    ref = records[0]
    for r, rec in enumerate(records):
        if rec.version != VERSION:
            raise RankMismatchError(
                f"rank {rec.rank if rec.version >= 0 else r} sent an agreement record of layout {rec.version if rec.version >= 0 else 'unknown'} "
                f"but this rank reads layout {VERSION}: every rank must run the same hostir version"
            )
    calls = [(rec.fusion, rec.call) for rec in records]
    if any(c != calls[0] for c in calls):
        where = ", ".join(f"rank {rec.rank} at call {rec.call} of fusion {rec.fusion}" for rec in records)
        raise RankMismatchError(
            f"the ranks are out of step: {where}. A rank skipped or repeated an execute: every rank "
            f"must call execute on the same fusions in the same order (fusions are numbered in the "
            f"order they first ran, calls from 0)"
        )
    failed = [rec for rec in records if rec.error is not None]
    if failed and cause is not None and len(failed) == len(records) and len(set(_error_types(records))) == 1:
        # Every rank failed the same check: no disagreement, each rank's
        # own error, of the type one rank alone would raise.
        raise cause
    if failed:
        first = failed[0]
        others = f" (ranks {', '.join(str(rec.rank) for rec in failed)} failed)" if len(failed) > 1 else ""
        failure = f"rank {first.rank} failed before the program ran{others}: {first.error}"
        # Where the inputs differ too, they come first: they are what the
        # ranks disagree on, and the likely cause of the failure.
        differing = next((rec for rec in records if rec.inputs_digest != ref.inputs_digest), None)
        if differing is not None:
            failure = f"{_inputs_difference(differing, ref)}; and {failure}"
        raise RankMismatchError(failure) from cause
    # Other shapes lower another program (its schedule is chosen per
    # shape): where inputs differ, they are named first, and the programs
    # too where those differ as well (another definition may be the cause).
    for rec in records[1:]:
        program = None
        if rec.digest != ref.digest:
            program = (
                f"the host program differs across ranks: rank {rec.rank} lowered program {_short(rec.digest)} "
                f"but rank {ref.rank} lowered {_short(ref.digest)}; every rank must define and schedule the same "
                f"fusion (print it with HOSTIR_DUMP=host_ir HOSTIR_DUMP_RANKS=all)"
            )
        inputs = None if rec.inputs_digest == ref.inputs_digest else _inputs_difference(rec, ref)
        if inputs is not None:
            raise RankMismatchError(inputs + (f"; and {program}" if program else ""))
        if program is not None:
            raise RankMismatchError(program)
    return any(rec.needs_groups for rec in records)


def _error_types(records: list[Record]) -> list[str]:
    """The type name of each rank's local error ("" for none)."""
    return [(rec.error or "").partition(":")[0] for rec in records]


def everyone_quiet(records: list[Record]) -> bool:
    """Whether no rank's program posts any communication (checked records:
    the same program everywhere)."""
    return all(rec.quiet for rec in records)


def _short(digest: bytes | None) -> str:
    return "(none: it failed to lower)" if digest is None else digest.hex()[:12]


# -- the step of a call whose signature the ranks agreed on

STEP_MAGIC = 0x4849_5243_0000_0000 | VERSION  # "HIRC" and the layout version
STEP_WORDS = 7


class Step(NamedTuple):
    """One rank's step, decoded (a tuple: built on every steady call)."""

    rank: int
    fusion: int
    call: int
    comm_call: int
    token: int
    chain: int = 0
    valid: bool = True


def token(digest: str | None, inputs) -> int:
    """The token of an agreed signature: a nonzero 63-bit hash of the
    program's digest and the inputs' dtypes and shapes (the same on every
    rank that agreed on them; never Python's salted `hash`)."""
    text = f"{digest};" + ";".join("-" if dtype is None else f"{dtype}{shape}" for dtype, shape in inputs)
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    return value or 1


def exchange_steps(comm, rank: int, fusion: int, call: int, comm_call: int, agreed: int, chain: int = 0) -> list[Step]:
    """Every rank's step, in rank order: STEP_WORDS words through the
    communicator's `exchange_step` (the shared-memory mailbox of ranks on
    one host, else one all-gather on the control group). `agreed` is the
    call's token, 0 on the full path; `chain` that of the quiet calls since
    the last exchanged step."""
    return post_steps(comm, rank, fusion, call, comm_call, agreed, chain)()


def post_steps(
    comm, rank: int, fusion: int, call: int, comm_call: int, agreed: int, chain: int = 0
) -> Callable[[], list[Step]]:
    """`exchange_steps` in two halves (the communicator's `post_step`): this
    rank's step posted now, every rank's collected by the returned call."""
    collect = comm.post_step([STEP_MAGIC, rank, fusion, call, comm_call, agreed, chain])

    def steps() -> list[Step]:
        return [Step(row[1], row[2], row[3], row[4], row[5], row[6], row[0] == STEP_MAGIC) for row in collect()]

    return steps


def in_step(steps: list[Step]) -> bool:
    """Whether every rank is at the same call, with the same nonzero token."""
    first = steps[0]
    if not first.valid or first.token == 0:
        return False
    where = (first.fusion, first.call, first.comm_call, first.token, first.chain)
    return all(s.valid and (s.fusion, s.call, s.comm_call, s.token, s.chain) == where for s in steps[1:])


def check_steps(steps: list[Step]) -> None:
    """After the full record agreed: raise `RankMismatchError` if the steps
    still differ in what the full record does not carry (the layout, the
    communicator's call numbers, the chains of quiet calls)."""
    for r, step in enumerate(steps):
        if not step.valid:
            raise RankMismatchError(
                f"rank {step.rank if step.rank >= 0 else r} sent a call step of another layout: every rank must run the same hostir "
                f"version and pass the same check_ranks"
            )
    numbers = [s.comm_call for s in steps]
    if any(n != numbers[0] for n in numbers):
        where = ", ".join(f"rank {s.rank} at its multi-device execute {s.comm_call}" for s in steps)
        raise RankMismatchError(
            f"the ranks are out of step: {where} (counted from 0 on this communicator). A rank skipped or "
            f"repeated an execute of another fusion: every rank must call execute on the same fusions in "
            f"the same order"
        )
    chains = [s.chain for s in steps]
    if any(c != chains[0] for c in chains):
        differing = [s.rank for s in steps if s.chain != chains[0]]
        raise RankMismatchError(
            f"the ranks are out of step: since the last call that communicated, ranks {differing} made "
            f"other calls without communication than rank {steps[0].rank} (another fusion, another signature, or a call "
            f"that failed on some ranks only); every rank must call execute on the same fusions in the "
            f"same order"
        )
