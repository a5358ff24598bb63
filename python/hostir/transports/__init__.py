"""Collectives and point-to-point communications behind one `post(...)`.

The evaluator asks for a communication; the transport the op names
(`backend=` in the dump: NCCL, gloo or cuda) translates it, each in one
module: `torch_dist` for NCCL and gloo, `cuda` for copy-engine pushes into
symmetric memory. A root given as a scalar (a loop index) is resolved here,
once, for every transport. Importing this package needs no CUDA.
"""

from __future__ import annotations

from hostir import ir
from hostir.transports.base import NoWork, Posted, Transport
from hostir.transports.torch_dist import TorchDistTransport

__all__ = ["NoWork", "Posted", "Transport", "post", "post_p2p", "end_coalescing", "allocate", "transport_for"]

_TORCH = {"NCCL": TorchDistTransport("NCCL"), "gloo": TorchDistTransport("gloo")}


def transport_for(ev, backend: str) -> Transport:
    """The transport of `backend` for the evaluator's communicator."""
    found = _TORCH.get(backend)
    if found is not None:
        return found
    if backend == "cuda":
        from hostir.transports import cuda

        return cuda.for_communicator(ev.communicator)
    raise ValueError(f"unknown backend {backend!r}; expected NCCL, gloo or cuda")


def resolve_root(ev, e: ir.Communication) -> int | None:
    """The root as a global rank (a scalar root is evaluated now)."""
    if e.root is None:
        return None
    root = int(ev.get(e.root)) if isinstance(e.root, ir.Scalar) else int(e.root)
    if root not in e.team:
        raise ValueError(f"root {root} is not in team {e.team}")
    return root


def post(ev, e: ir.Communication, group) -> Posted:
    return transport_for(ev, e.backend).post(ev, e, group, resolve_root(ev, e))


def post_p2p(ev, e: ir.P2PCommunication, buf, peer: int, ops: list | None) -> Posted:
    return transport_for(ev, e.backend).post_p2p(ev, e, buf, peer, ops)


def end_coalescing(ev, backend: str, ops: list) -> Posted:
    return transport_for(ev, backend).end_coalescing(ev, ops)


def allocate(ev, tv: ir.TensorView, shape):
    """A buffer for `tv` in memory a transport owns (symmetric memory)."""
    return transport_for(ev, "cuda").allocate(ev, tv, shape)
