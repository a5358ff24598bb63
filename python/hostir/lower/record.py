"""What a lowering takes and what it gives back.

`LoweringOptions` are the arguments of `lower` beyond the fusion: the rank
to lower for, the backend, the schedule and the rest. The passes take their
part of them as arguments (`pass_options`). `LoweredProgram` is what `lower`
returns: the host program, which holds ops and values only, beside what
running it needs to know of the lowering: the digest the ranks compare, the
teams whose process groups they create, the axes a decomposition cut into
chunks, and the options it was lowered with.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from hostir import ir
from hostir.container import HostIrContainer
from hostir.errors import HostIrError
from hostir.lower.hoist_transfers import Hoisting
from hostir.lower.insert_reshardings import MODES as RESHARDING_MODES
from hostir.lower.schedule import Schedule


class LoweringError(HostIrError, ValueError):
    """A fusion that cannot be lowered; the message names the pass."""


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
    """How to lower a fusion.

    rank: the rank whose part of a multi-device program to keep
        (`prune_for_rank`); None keeps every rank's. A program without
        meshes is the same on every rank and is never pruned.
    backend: the communication backend the program's communications name
        (`NCCL`, `gloo` or `cuda`, in any case).
    resharding: `insert_reshardings`' mode: "auto", "before", "after", or
        "strict", which refuses an op that computes and reshards.
    schedule: how `decompose_device_axis` decomposes a device axis walked
        as a stream axis (None: a ring, one chunk per peer).
    stream_form: `assign_streams`' form of every stream loop ("pipelined"
        or "per_iteration"; None: the form `assign_streams` chooses for the
        program, pipelined for a multi-device one).
    host_inputs: positions of inputs passed in host memory to stream (as if
        defined with `memory="host"`).
    hoisting: how far `hoist_transfers` moves communications and transfers
        (None: `Hoisting()`, as early as operands and the default budget
        allow); its `chunks` are `lower_transfers`' pieces.
    """

    rank: int | None = None
    backend: str = "NCCL"
    resharding: str = "auto"
    schedule: Schedule | None = None
    stream_form: str | None = None
    host_inputs: frozenset[int] = frozenset()
    hoisting: Hoisting | None = None

    def __post_init__(self) -> None:
        if self.resharding not in RESHARDING_MODES:
            raise LoweringError(f"resharding must be one of {list(RESHARDING_MODES)}, got {self.resharding!r}")
        object.__setattr__(self, "backend", ir.backend_name(self.backend))
        object.__setattr__(self, "host_inputs", frozenset(self.host_inputs))


class ChunkedAxis(NamedTuple):
    """An axis of symbolic extent that a decomposition cuts into `parts`
    chunks: the runtime checks that its size divides (`where` names it)."""

    extent: ir.Scalar
    parts: int
    where: str


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
    """What `lower` returns.

    program: the host program (with `until`, the program right after that
        pass).
    options: what it was lowered with.
    digest: the hash of the program's dump before pruning for a rank, the
        same on every rank that lowered the same fusion the same way (None
        when `until` stopped before the end of `PIPELINE`).
    teams: the teams of every rank's communications, sorted: the process
        groups every rank creates, in this order, before the first run
        (empty when `until` stopped before the end of `PIPELINE`).
    chunking: the axes of symbolic extent a decomposition cut into chunks.
    rank: the rank the program was pruned for; None for a program that
        holds every rank's part (no meshes, no rank asked, or `until`
        stopped before `prune_for_rank`). Whoever runs or analyses the
        program passes it on: a tensor on a mesh without this rank is not
        held.
    """

    program: HostIrContainer
    options: LoweringOptions
    digest: str | None = None
    teams: tuple[tuple[int, ...], ...] = ()
    chunking: tuple[ChunkedAxis, ...] = ()
    rank: int | None = None

    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def schedule(self) -> Schedule | None:
        return self.options.schedule

    @property
    def hoisting(self) -> Hoisting | None:
        return self.options.hoisting
