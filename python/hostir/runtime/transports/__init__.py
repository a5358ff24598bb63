"""Collectives and point-to-point communications behind one `post(...)`.

The evaluator asks for a communication, handing over the run's frame; the
transport the op names (`backend=` in the dump: NCCL, gloo or cuda)
translates it, each in one module: `torch_dist` for NCCL and gloo, `cuda`
for copy-engine pushes into memory that peers map, `host` for transfers
between host and device memory. A backend's entry in `hostir.backends`
names its module, whose `for_frame(frame, backend)` gives the transport: a
new transport needs no edit here. A root given as a scalar (a loop index)
is resolved here, once, for every transport. Importing this package needs
no CUDA.
"""

from __future__ import annotations

import importlib
from typing import Callable

from hostir import backends, ir
from hostir.runtime.transports.base import (
    Capabilities,
    NoWork,
    Posted,
    Transport,
    TransportError,
    TransportUnsupported,
    TransportUsageError,
)
from hostir.runtime.transports.host import HostStaging, allocate_host, copy_in_order, post_transfer

__all__ = [
    "Capabilities",
    "HostStaging",
    "NoWork",
    "Posted",
    "Transport",
    "TransportError",
    "TransportUnsupported",
    "TransportUsageError",
    "allocate",
    "capabilities",
    "allocate_host",
    "end_coalescing",
    "post",
    "post_p2p",
    "copy_in_order",
    "post_transfer",
    "transport_for",
]

# The function each backend's module has (`hostir.backends`, `module`).
ENTRY_POINT = "for_frame"

_ENTRY_POINTS: dict[str, Callable[..., Transport]] = {}


def _entry_point(backend: backends.Backend) -> Callable[..., Transport]:
    """The `for_frame` of the module `backend`'s entry names. The one
    import by name in the package: `hostir.backends` sits below the runtime
    and names its modules as strings, so that a new transport is its entry
    and its module, and no list here."""
    found = _ENTRY_POINTS.get(backend.module)
    if found is not None:
        return found
    name = f"{__name__}.{backend.module}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        raise TransportUsageError(
            f"the backend {backend.name!r} names the transport module {name}, which does not exist"
        ) from None
    found = getattr(module, ENTRY_POINT, None)
    if not callable(found):
        raise TransportUsageError(
            f"the backend {backend.name!r} names the transport module {name}, "
            f"which has no {ENTRY_POINT}(frame, backend)"
        )
    _ENTRY_POINTS[backend.module] = found
    return found


def capabilities(backend: str) -> Capabilities:
    """What the transport named `backend` (NCCL, gloo or cuda) can do, as
    `hostir.backends` declares it."""
    found = backends.BACKENDS.get(backend)
    if found is None:
        raise TransportUsageError(f"unknown backend {backend!r}; expected one of {list(backends.NAMES)}")
    return found.capabilities


def transport_for(frame, backend: str) -> Transport:
    """The transport of `backend` for the frame's communicator; a
    communicator that carries a transport of its own (the dry run's
    recorder) takes every backend's communications."""
    own = getattr(frame.communicator, "transport", None)
    if own is not None:
        return own
    try:
        backend = ir.backend_name(backend)
    except ir.DefinitionError:
        raise TransportUsageError(f"unknown backend {backend!r}; expected NCCL, gloo or cuda (in any case)") from None
    return _entry_point(backends.BACKENDS[backend])(frame, backend)


def resolve_root(frame, e: ir.Communication) -> int | None:
    """The root as a global rank (a scalar root is evaluated now)."""
    if e.root is None:
        return None
    root = int(frame.get(e.root)) if isinstance(e.root, ir.Scalar) else int(e.root)
    if root not in e.team:
        raise TransportUsageError(f"root {root} is not in team {e.team}")
    return root


def post(frame, e: ir.Communication, group) -> Posted:
    return transport_for(frame, e.backend).post(frame, e, group, resolve_root(frame, e))


def post_p2p(frame, e: ir.P2PCommunication, buf, peer: int, ops: list | None) -> Posted:
    return transport_for(frame, e.backend).post_p2p(frame, e, buf, peer, ops)


def end_coalescing(frame, backend: str, ops: list) -> Posted:
    return transport_for(frame, backend).end_coalescing(frame, ops)


def allocate(frame, tv: ir.TensorView, shape):
    """A buffer for `tv` in memory a transport owns (symmetric memory)."""
    return transport_for(frame, "cuda").allocate(frame, tv, shape)
