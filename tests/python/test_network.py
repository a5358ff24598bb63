"""hostir.network: the interface gloo binds to, chosen from GLOO_SOCKET_IFNAME
or the route to the rendezvous address, and the Communicator's use of it.

The route and the interface list are replaced by fakes where a test needs a
node with other interfaces; the real lookups are exercised on loopback only,
so nothing here sends a packet. The two-node runs are in test_multinode.py.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from hostir import communicator, network
from hostir.communicator import Communicator, LaunchError, LaunchInfo
from hostir.network import GlooInterface, InterfaceError, choose_gloo_interface

# A node with two interfaces besides loopback, one without an IPv4 address.
FAKE_INTERFACES = {"lo": "127.0.0.1", "eth0": "192.0.2.7", "ib0": "10.20.0.7", "tun0": None}


@pytest.fixture
def fake_node(monkeypatch):
    """This node has FAKE_INTERFACES; every route leaves from the address in
    `routes[destination]` (ib0's by default)."""
    routes: dict[str, str] = {}
    monkeypatch.setattr(network, "interface_addresses", lambda: dict(FAKE_INTERFACES))
    monkeypatch.setattr(network, "route_source", lambda address, port: routes.get(address, "10.20.0.7"))
    monkeypatch.setattr(network, "_resolve_ipv4", lambda host: {"node0": "10.20.0.1"}.get(host, host))
    return routes


def test_loopback_is_listed_with_its_address():
    assert network.interface_addresses()["lo"] == "127.0.0.1"


def test_route_to_loopback_leaves_from_loopback():
    assert network.route_source("127.0.0.1", 29500) == "127.0.0.1"


def test_route_is_chosen_through_the_interface_that_holds_its_source(fake_node):
    chosen = choose_gloo_interface("10.20.0.1", 29500, {})
    assert chosen == GlooInterface("ib0", "10.20.0.7", "the route to the rendezvous address 10.20.0.1")


def test_rendezvous_host_name_is_resolved_before_the_route(fake_node):
    fake_node["10.20.0.1"] = "192.0.2.7"
    assert choose_gloo_interface("node0", 29500, {}).name == "eth0"


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_rendezvous_keeps_gloos_default(fake_node, address):
    chosen = choose_gloo_interface(address, 29500, {})
    assert (chosen.name, chosen.address) == (None, None)
    assert "loopback" in chosen.reason


def test_rendezvous_reached_through_loopback_keeps_gloos_default(fake_node):
    # Rank 0's node, whose host name resolves to one of its loopback addresses.
    fake_node["10.20.0.1"] = "127.0.1.1"
    chosen = choose_gloo_interface("10.20.0.1", 29500, {})
    assert chosen.name is None
    assert "this node's loopback" in chosen.reason


def test_route_source_no_interface_holds_keeps_gloos_default(fake_node):
    fake_node["10.20.0.1"] = "10.99.0.3"
    chosen = choose_gloo_interface("10.20.0.1", 29500, {})
    assert (chosen.name, chosen.address) == (None, "10.99.0.3")
    assert "no interface holds 10.99.0.3" in chosen.reason


def test_named_interface_wins_over_the_route(fake_node):
    chosen = choose_gloo_interface("10.20.0.1", 29500, {"GLOO_SOCKET_IFNAME": "eth0"})
    assert chosen == GlooInterface("eth0", "192.0.2.7", "GLOO_SOCKET_IFNAME=eth0")


def test_named_interfaces_may_be_a_comma_list(fake_node):
    chosen = choose_gloo_interface("10.20.0.1", 29500, {"GLOO_SOCKET_IFNAME": "ib0,eth0"})
    assert (chosen.name, chosen.address) == ("ib0", "10.20.0.7")


def test_named_interface_this_node_lacks_is_named_with_the_ones_it_has(fake_node):
    with pytest.raises(InterfaceError, match=r"GLOO_SOCKET_IFNAME='eth0,ens5' names 'ens5'.*eth0, ib0, lo, tun0"):
        choose_gloo_interface("10.20.0.1", 29500, {"GLOO_SOCKET_IFNAME": "eth0,ens5"})


# --- the Communicator ----------------------------------------------------------

_VARIABLES = ("HOSTIR_MASTER_ADDR", "HOSTIR_MASTER_PORT", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
# Rank 2 of 4, two ranks per node: a job over two nodes.
SECOND_NODE = LaunchInfo(rank=2, world_size=4, local_rank=0, local_size=2, source="Open MPI")


@pytest.fixture
def clean_env(monkeypatch):
    """No rendezvous or interface variables; whatever the Communicator
    exports is undone afterwards."""
    for name in _VARIABLES:
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    yield
    communicator.shutdown()
    assert not dist.is_initialized()


def test_job_over_several_nodes_without_a_rendezvous_address_is_refused(clean_env):
    with pytest.raises(LaunchError, match=r"2 of the 4 processes on this node.*set HOSTIR_MASTER_ADDR"):
        Communicator(backend="gloo", launch=SECOND_NODE)


def test_job_on_one_node_keeps_the_loopback_default(clean_env, monkeypatch):
    one_node = LaunchInfo(rank=0, world_size=1, local_rank=0, local_size=1, source="Open MPI")
    comm = Communicator(backend="gloo", launch=one_node)
    assert (comm.master_addr, comm.interface) == ("127.0.0.1", None)
    comm.shutdown()


def test_unknown_interface_variable_is_refused_before_the_rendezvous(clean_env, monkeypatch):
    monkeypatch.setenv("HOSTIR_MASTER_ADDR", "10.20.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(LaunchError, match=r"GLOO_SOCKET_IFNAME='no-such-if0' names 'no-such-if0'"):
        Communicator(backend="gloo", launch=SECOND_NODE)


def test_unroutable_rendezvous_address_is_refused_before_the_rendezvous(clean_env, fake_node, monkeypatch):
    def unreachable(address, port):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(network, "route_source", unreachable)
    monkeypatch.setenv("HOSTIR_MASTER_ADDR", "10.20.0.1")
    with pytest.raises(LaunchError, match=r"cannot route to the rendezvous address 10\.20\.0\.1:29500"):
        Communicator(backend="gloo", launch=SECOND_NODE)


def test_routed_interface_is_exported_for_gloo(clean_env, fake_node):
    chosen = communicator._choose_interface("10.20.0.1", 29500)
    assert chosen.name == "ib0"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


def test_named_interface_is_left_as_named(clean_env, fake_node, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,ib0")
    assert communicator._choose_interface("10.20.0.1", 29500).name == "eth0"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0,ib0"


def test_loopback_rendezvous_exports_nothing(clean_env, fake_node):
    assert communicator._choose_interface("127.0.0.1", 29500).name is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ
