"""What every transport gives the evaluator: a posted communication and the
interface a backend implements.

A transport translates normalized communications (an `ir.Communication` or
`ir.P2PCommunication` with its buffers already bound) into its own calls and
returns a `Posted`; the `Wait` of the program waits for the posted works and
then runs `after`. Evaluators never branch on the backend: they ask
`hostir.runtime.transports.post(...)` and wait for what comes back.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from hostir.backends import Capabilities
from hostir.errors import HostIrError

__all__ = ["Capabilities", "NoWork", "Posted", "Transport", "TransportError", "TransportUnsupported", "TransportUsageError"]


class TransportError(HostIrError, RuntimeError):
    """A transport could not move data (a driver call failed, no way to map
    peer memory)."""


class TransportUsageError(HostIrError, ValueError):
    """A communication a transport cannot take (unknown backend, a buffer
    outside its windows, a bad root or peer)."""


class TransportUnsupported(HostIrError, NotImplementedError):
    """An operation the chosen transport does not implement."""


@dataclasses.dataclass
class Posted:
    """A posted communication: its works (each with `wait()`), and what to
    do after they finish (copy a staging buffer into a non-contiguous or
    reshaped output)."""

    works: list
    after: Callable[[], None] | None = None


class NoWork:
    """A work that is already complete (a copy done in place)."""

    def wait(self, *args) -> bool:
        return True


class Transport:
    """One backend's translation of communications.

    `post` starts a collective, `post_p2p` a send or receive (or adds it to
    the open coalescing group `ops`), `end_coalescing` posts such a group;
    `allocate` makes a buffer of a memory type the transport owns."""

    name = "?"
    capabilities = Capabilities()

    def post(self, frame, e, group, root: int | None) -> Posted:
        raise TransportUnsupported(f"the {self.name} transport has no collectives")

    def post_p2p(self, frame, e, buf, peer: int, ops: list | None) -> Posted:
        raise TransportUnsupported(f"the {self.name} transport has no point-to-point communications")

    def end_coalescing(self, frame, ops: list) -> Posted:
        return Posted([])

    def allocate(self, frame, tv, shape):
        raise TransportUnsupported(f"the {self.name} transport allocates no buffers")
