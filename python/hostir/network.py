"""Which network interface a rank's gloo transport binds to.

gloo binds every rank to one address and tells its peers to connect there. Left
to itself it takes the address the machine's hostname resolves to, and falls
back to the loopback address when that is not usable; a hostname listed as
127.0.0.1 or 127.0.1.1 in /etc/hosts (a common default) is such a case. On one
machine that works; across machines the peers then dial their own loopback and
the job times out while the groups connect. `choose_gloo_interface` decides the
interface before any group exists: the one in `GLOO_SOCKET_IFNAME` when set
(checked to exist on this node), else the interface the kernel routes the
rendezvous address through, so that every rank binds where rank 0 is
reachable. A loopback rendezvous address (a single-machine job) leaves gloo's
own choice alone. Only IPv4 interfaces are looked up, with Linux's ioctl.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from hostir.errors import HostIrError

__all__ = ["GlooInterface", "InterfaceError", "choose_gloo_interface", "interface_addresses", "route_source"]

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16


class InterfaceError(HostIrError, ValueError):
    """GLOO_SOCKET_IFNAME names an interface this node does not have."""


@dataclass(frozen=True)
class GlooInterface:
    """The interface gloo binds to: `name`, its IPv4 `address` (None where it
    has none or gloo's own choice is kept) and `reason`, one phrase for logs
    and errors."""

    name: str | None
    address: str | None
    reason: str


def interface_addresses() -> dict[str, str | None]:
    """This node's interfaces, each with its (first) IPv4 address or None."""
    import fcntl  # POSIX only; importing hostir must work everywhere

    addresses: dict[str, str | None] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                addresses[name] = None
                continue
            addresses[name] = socket.inet_ntoa(reply[20:24])
    return addresses


def route_source(address: str, port: int) -> str:
    """The local IPv4 address the kernel would send from to reach
    `address:port`. Connecting a UDP socket only looks the route up: no
    packet is sent. Raises OSError when there is no route or no IPv4 address
    for `address`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((address, port))
        return sock.getsockname()[0]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _resolve_ipv4(host: str) -> str:
    infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return infos[0][4][0]


def choose_gloo_interface(master_addr: str, master_port: int, env: Mapping[str, str]) -> GlooInterface:
    """The interface gloo should bind to on this node, for a job whose
    rendezvous is at `master_addr:master_port`. Raises InterfaceError when
    `GLOO_SOCKET_IFNAME` names an interface this node lacks, and OSError
    when `master_addr` cannot be resolved or routed to."""
    interfaces = interface_addresses()
    requested = env.get(GLOO_IFNAME)
    if requested:
        # torch accepts a comma list (one device per name); each must exist.
        names = [name.strip() for name in requested.split(",")]
        missing = [name for name in names if name not in interfaces]
        if missing:
            raise InterfaceError(
                f"{GLOO_IFNAME}={requested!r} names {', '.join(repr(n) for n in missing)}, which this "
                f"node does not have (its interfaces: {', '.join(sorted(interfaces))})"
            )
        return GlooInterface(names[0], interfaces[names[0]], f"{GLOO_IFNAME}={requested}")
    if _is_loopback(master_addr):
        return GlooInterface(None, None, f"gloo's default (rendezvous address {master_addr} is loopback)")
    source = route_source(_resolve_ipv4(master_addr), master_port)
    if _is_loopback(source):
        return GlooInterface(None, None, f"gloo's default (rendezvous address {master_addr} is this node's loopback)")
    for name, address in interfaces.items():
        if address == source:
            return GlooInterface(name, address, f"the route to the rendezvous address {master_addr}")
    return GlooInterface(None, source, f"gloo's default (no interface holds {source}, the route to {master_addr})")
