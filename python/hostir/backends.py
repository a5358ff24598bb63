"""The communication backends, declared once: what each is called, what it
can do, which process groups it needs, what the C++ executor runs and what
the machine model charges its traffic with.

Every layer reads this table and none keeps a list of its own: the IR and
the schedule text check a backend's spelling here, the lowering asks a
backend's capabilities (never its name), the runtime makes one transport per
entry, the flat compiler and the machine model read `cpp`, and the executor
maps a communicator's process-group backend to the programs' name. A new
transport is one entry here, one module in `hostir/runtime/transports/`
(which its entry names, as a string: this table imports no runtime) and,
for the C++ executor, one file in `csrc/host_ir/transports/`
(`tests/python/test_backends_table.py` holds the table to what the C++
executor reports).
"""

from __future__ import annotations

import dataclasses

from hostir.errors import DefinitionError

__all__ = ["BACKENDS", "NAMES", "Backend", "Capabilities", "backend_name", "get", "of_process_group"]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a transport can do, as the lowering asks it (never its name).

    one_sided: a send writes straight into a buffer the peer named (a push
        `into` it); the peer posts no matching receive to move the data.
    needs_symmetric_buffers: what it writes into must be allocated in
        symmetric memory (the same allocation on every rank, mapped by the
        peers).
    uses_no_sms: it moves data with copy engines, taking no SMs from the
        compute it overlaps."""

    one_sided: bool = False
    needs_symmetric_buffers: bool = False
    uses_no_sms: bool = False


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend. `name`: its spelling in dumps and schedules.
    `process_group`: the torch.distributed backend of a communicator that
    runs it ("nccl", "gloo"), or None for a transport that rides any
    communicator's groups (the copy engine). `p2p_memory`: what its sends
    and receives read and write ("device", "host", or "symmetric" windows).
    `cpp`: whether the C++ executor runs its communications. `bandwidth`:
    the machine model's figure for its traffic ("collective": the
    all-gather bus bandwidth; "copy": a copy-engine push to a peer).
    `module`: the module of `hostir.runtime.transports` that implements
    it, which has a `for_frame(frame, backend) -> Transport` (the
    transports package finds the transport of a backend through it)."""

    name: str
    capabilities: Capabilities
    process_group: str | None
    p2p_memory: str
    cpp: bool
    bandwidth: str
    module: str


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "NCCL", Capabilities(), "nccl", p2p_memory="device", cpp=True, bandwidth="collective", module="torch_dist"
        ),
        Backend(
            "gloo", Capabilities(), "gloo", p2p_memory="host", cpp=True, bandwidth="collective", module="torch_dist"
        ),
        Backend(
            "cuda",
            Capabilities(one_sided=True, needs_symmetric_buffers=True, uses_no_sms=True),
            None,
            p2p_memory="symmetric",
            cpp=True,
            bandwidth="copy",
            module="cuda",
        ),
    )
}
NAMES: tuple[str, ...] = tuple(BACKENDS)


def backend_name(name: object) -> str:
    """The one spelling of a backend (`NCCL`, `gloo` or `cuda`, as dumps
    print it), whatever the case `name` is written in."""
    if isinstance(name, str):
        for known in NAMES:
            if name.strip().lower() == known.lower():
                return known
    raise DefinitionError(f"unknown backend {name!r}; expected one of {', '.join(NAMES)} (in any case)")


def get(name: object) -> Backend:
    """The backend spelled `name` (in any case)."""
    return BACKENDS[backend_name(name)]


def of_process_group(process_group: str) -> Backend:
    """The backend whose communicator runs `process_group` ("nccl" or "gloo")."""
    for b in BACKENDS.values():
        if b.process_group == process_group:
            return b
    raise DefinitionError(f"no backend runs process groups of {process_group!r}")
