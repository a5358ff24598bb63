"""How a decomposed device axis runs: decomposition, chunks per peer,
ring direction and transport, and its text form.

A `Schedule` is what `lower` hands `decompose_device_axis`; the machine
model (`hostir.machine`) chooses one per input signature, and
`HOSTIR_SCHEDULE` (or `ExecutorParams.schedule`) forces one: `ring`,
`collective`, `sequential`, with optional
`:chunks=<n>,direction=<+1|-1>,transport=<cuda|NCCL|gloo>`.
"""

from __future__ import annotations

import dataclasses

from hostir import backends
from hostir.errors import ScheduleError

__all__ = ["DECOMPOSITIONS", "TRANSPORTS", "Schedule", "ScheduleError", "parse"]

DECOMPOSITIONS = ("ring", "collective", "sequential")
# The backends a ring's P2P communications may name (`hostir.backends`).
TRANSPORTS = backends.NAMES


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`decomposition`: ring, collective (broadcast on the gather side,
    reduce on the reduce side) or sequential. `chunks`: row pieces per peer.
    `direction`: +1 receives from position p+i at step i, -1 from p-i.
    `transport`: backend of the ring's P2P communications (None: the
    program's backend). `note`: why (printed in the loop's head)."""

    decomposition: str = "ring"
    chunks: int = 1
    direction: int = 1
    transport: str | None = None
    note: str = ""

    def __post_init__(self):
        if self.decomposition not in DECOMPOSITIONS:
            raise ScheduleError(f"unknown decomposition {self.decomposition!r}; expected one of {list(DECOMPOSITIONS)}")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ScheduleError(f"chunks per peer must be an integer >= 1, got {self.chunks!r}")
        if self.direction not in (1, -1):
            raise ScheduleError(f"ring direction must be +1 or -1, got {self.direction!r}")
        if self.transport is not None:
            known = {t.lower(): t for t in TRANSPORTS}.get(str(self.transport).lower())
            if known is None:
                raise ScheduleError(f"unknown transport {self.transport!r}; expected one of {list(TRANSPORTS)} (in any case)")
            object.__setattr__(self, "transport", known)

    def with_chunks(self, chunks: int) -> Schedule:
        return dataclasses.replace(self, chunks=chunks)

    def key(self) -> tuple:
        return (self.decomposition, self.chunks, self.direction, self.transport, self.note)


def parse(text: str) -> Schedule:
    """`ring:chunks=2,direction=-1,transport=cuda` -> Schedule."""
    name, _, rest = text.strip().partition(":")
    fields: dict = {"decomposition": name.strip()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ScheduleError(f"schedule {text!r}: expected key=value, got {item!r}")
        key = key.strip()
        if key == "chunks":
            try:
                fields["chunks"] = int(value)
            except ValueError:
                raise ScheduleError(f"schedule {text!r}: chunks must be an integer, got {value!r}") from None
        elif key == "direction":
            if value.strip() not in ("1", "+1", "-1"):
                raise ScheduleError(f"schedule {text!r}: direction must be +1 or -1, got {value!r}")
            fields["direction"] = int(value)
        elif key == "transport":
            fields["transport"] = value.strip()
        else:
            raise ScheduleError(f"schedule {text!r}: unknown key {key!r} (chunks, direction, transport)")
    return Schedule(**fields)
