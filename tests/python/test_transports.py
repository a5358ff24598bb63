"""The transports package without a GPU: it imports, names its backends,
resolves scalar roots once for every transport, and its cuda transport
says why it cannot run on CPU ranks (the lowering then falls back and the
dump says so)."""

from __future__ import annotations

import types

import pytest
import torch

from hostir import ir, overlap
from hostir.runtime import transports
from hostir.container import HostIrContainer
from hostir.lower import lower
from hostir.lower.schedule import Schedule
from hostir.runtime.transports import cuda


def _fake_comm(device="cpu", world=2, local_size=2):
    launch = types.SimpleNamespace(local_size=local_size)
    return types.SimpleNamespace(device=torch.device(device), world_size=world, rank=0, launch=launch, timeout=5.0)


def test_nccl_and_gloo_share_one_translation():
    ev = types.SimpleNamespace(communicator=_fake_comm())
    assert transports.transport_for(ev, "NCCL").name == "NCCL"
    assert transports.transport_for(ev, "gloo").name == "gloo"
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        transports.transport_for(ev, "mpi")


def test_a_scalar_root_is_evaluated_and_checked_against_the_team():
    c = HostIrContainer()
    tv = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(2))], torch.float32)
    index = ir.Scalar(label="StreamIdx")
    comm = ir.Communication(0, ir.CommunicationType.Broadcast, tv, tv, (0, 1), root=index + 0)
    values = {index: 1}

    class Ev:
        def get(self, v):
            if isinstance(v, ir.ScalarExpr):
                return ir.ScalarExpr.OPS[v.op](self.get(v.lhs), self.get(v.rhs))
            return values.get(v, v.value)

    assert transports.resolve_root(Ev(), comm) == 1
    values[index] = 5
    with pytest.raises(ValueError, match=r"root 5 is not in team \(0, 1\)"):
        transports.resolve_root(Ev(), comm)


def test_cuda_transport_refuses_cpu_ranks_with_a_reason():
    assert "the ranks run on cpu" in cuda.local_reason(_fake_comm("cpu"))


def test_cuda_transport_probe_is_asked_once_per_communicator():
    comm = _fake_comm("cpu", world=1)
    first = cuda.probe(comm)
    comm.device = torch.device("cuda", 0)  # a later change is not seen: the answer is cached
    assert cuda.probe(comm) == first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_cuda_transport_window_kind_needs_no_cuda_to_answer():
    # Without visible GPUs two local ranks cannot each own one: CUDA IPC windows.
    assert cuda.window_kind(_fake_comm("cpu")) == "ipc"


def test_forced_window_kind_must_be_known(monkeypatch):
    monkeypatch.setenv("HOSTIR_CUDA_WINDOWS", "shm")
    with pytest.raises(ValueError, match="HOSTIR_CUDA_WINDOWS='shm'"):
        cuda.window_kind(_fake_comm())


def test_fallback_from_cuda_is_in_the_dump():
    sched = Schedule("ring", transport=None, note="cuda transport unavailable: the ranks run on cpu")
    dump = str(lower(overlap.allgather_matmul(2).fusion, rank=0, backend="gloo", schedule=sched))
    assert "transport=gloo, cuda transport unavailable: the ranks run on cpu" in dump


# ---------------------------------------------------------------- capabilities


def test_transports_declare_capabilities():
    from hostir.runtime import transports

    cuda, nccl, gloo = (transports.capabilities(n) for n in ("cuda", "NCCL", "gloo"))
    assert cuda == transports.Capabilities(one_sided=True, needs_symmetric_buffers=True, uses_no_sms=True)
    assert nccl == gloo == transports.Capabilities()
    with pytest.raises(transports.TransportUsageError, match="unknown backend 'mpi'"):
        transports.capabilities("mpi")


def test_the_lowering_asks_a_capability_not_a_name(monkeypatch):
    """A ring over gloo gets symmetric slots and one-sided pushes once gloo
    is declared to need and do them: the lowering reads the declaration."""
    from hostir import overlap
    from hostir.lower import lower
    from hostir.runtime import transports

    def ring(rank=0):
        return str(lower(overlap.allgather_matmul(2).fusion, rank=rank, backend="gloo", schedule=Schedule(transport="gloo")))

    plain = ring()
    assert "symmetric" not in plain and "into=" not in plain
    monkeypatch.setitem(
        transports._CAPABILITIES, "gloo", transports.Capabilities(one_sided=True, needs_symmetric_buffers=True)
    )
    declared = ring()
    assert "symmetric" in declared and "into=" in declared, declared
