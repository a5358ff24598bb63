"""The transports package without a GPU: it imports, names its backends,
resolves scalar roots once for every transport, and its cuda transport
says why it cannot run on CPU ranks (the lowering then falls back and the
dump says so)."""

from __future__ import annotations

import dataclasses
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


def test_cuda_transport_probe_is_asked_once_per_communicator_and_device(monkeypatch):
    comm = _fake_comm("cpu", world=1)
    asked = []
    real = cuda.local_reason
    monkeypatch.setattr(cuda, "local_reason", lambda c, d=None: asked.append(d) or real(c, d))
    first = cuda.probe(comm)
    assert cuda.probe(comm) == first and asked == [torch.device("cpu")]
    cuda.probe(comm, torch.device("cuda", 0))
    cuda.probe(comm, "cuda:0")
    assert asked == [torch.device("cpu"), torch.device("cuda", 0)]


def test_p2p_capability_follows_the_program_device_not_the_gloo_communicator():
    # A gloo communicator's device is the CPU; its ranks may still run the
    # program on a GPU (two ranks sharing one), where the cuda transport is
    # the one that can move device memory: the program's device decides.
    from hostir import planner

    comm = _fake_comm("cpu")
    assert planner.p2p_reason(comm) == "the ranks run on cpu"
    on_gpu = planner.p2p_reason(comm, torch.device("cuda", 0))
    assert on_gpu != "the ranks run on cpu"
    assert on_gpu == cuda.local_reason(comm, torch.device("cuda", 0))
    if not torch.cuda.is_available():
        assert on_gpu == "CUDA is unavailable"


def _p2p_program(backend: str, memory: ir.MemoryType) -> HostIrContainer:
    c = HostIrContainer()
    axes = [ir.IterDomain(c, ir.Scalar.constant(4)), ir.IterDomain(c, ir.Scalar.constant(8))]
    buf = ir.TensorView(c, axes, torch.float32, memory)
    c.push_back(ir.P2PCommunication(c.next_name("comm"), "send", buf, ir.Scalar.constant(1), backend=backend))
    return c


def test_a_gloo_send_of_device_memory_is_refused_when_lowered():
    from hostir.errors import HostIrError
    from hostir.runtime.transports import torch_dist

    program = _p2p_program("gloo", ir.MemoryType.global_)
    with pytest.raises(transports.TransportUnsupported, match="gloo sends and receives only host memory") as err:
        torch_dist.check_backends(program, torch.device("cuda", 0), "gloo")
    assert isinstance(err.value, HostIrError) and "cuda:0" in str(err.value)
    # Host memory, the CPU, and the other transports are fine.
    torch_dist.check_backends(program, torch.device("cpu"), "gloo")
    torch_dist.check_backends(_p2p_program("gloo", ir.MemoryType.host), torch.device("cuda", 0), "gloo")
    torch_dist.check_backends(_p2p_program("NCCL", ir.MemoryType.global_), torch.device("cuda", 0), "nccl")
    torch_dist.check_backends(_p2p_program("cuda", ir.MemoryType.symmetric), torch.device("cuda", 0), "gloo")


def test_an_nccl_post_through_a_gloo_communicator_is_refused_when_lowered():
    # A program that says NCCL on a communicator whose groups are gloo's
    # (the schedule's transport=nccl on a gloo communicator) would hand the
    # device pointers to gloo: refused, naming the op and both backends.
    from hostir.runtime.transports import torch_dist

    program = _p2p_program("NCCL", ir.MemoryType.global_)
    with pytest.raises(transports.TransportUnsupported) as err:
        torch_dist.check_backends(program, torch.device("cuda", 0), "gloo")
    text = str(err.value)
    assert "P2PCommunication 0" in text and "backend=NCCL" in text
    assert "the communicator runs gloo" in text and "backend='nccl'" in text


def test_an_nccl_post_of_host_memory_or_on_the_cpu_is_refused_when_lowered():
    from hostir.runtime.transports import torch_dist

    host = _p2p_program("NCCL", ir.MemoryType.host)
    with pytest.raises(transports.TransportUnsupported, match=r"NCCL carries device memory only, but T\d+_h"):
        torch_dist.check_backends(host, torch.device("cuda", 0), "nccl")
    on_cpu = _p2p_program("NCCL", ir.MemoryType.global_)
    with pytest.raises(transports.TransportUnsupported, match="the program runs on cpu"):
        torch_dist.check_backends(on_cpu, torch.device("cpu"), "nccl")
    # Without a communicator (a program lowered to be printed) nothing is posted.
    torch_dist.check_backends(on_cpu, torch.device("cpu"), None)


def test_a_collective_of_a_team_of_one_is_never_refused():
    # It moves nothing: its output is its input, on any backend.
    from hostir.runtime.transports import torch_dist

    c = HostIrContainer()
    axes = [ir.IterDomain(c, ir.Scalar.constant(4))]
    a = ir.TensorView(c, axes, torch.float32, ir.MemoryType.host)
    b = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.host)
    c.push_back(ir.Communication(c.next_name("comm"), ir.CommunicationType.Allreduce, b, a, (0,), red_op="sum"))
    torch_dist.check_backends(c, torch.device("cuda", 0), "nccl")


def test_a_gloo_send_of_a_cuda_buffer_is_refused_before_it_is_posted(monkeypatch):
    from hostir.runtime.transports import torch_dist

    posted = []
    monkeypatch.setattr(torch_dist.dist, "isend", lambda *a, **k: posted.append(a))
    program = _p2p_program("gloo", ir.MemoryType.global_)
    (e,) = list(program.walk())
    buf = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    gloo = transports.transport_for(types.SimpleNamespace(communicator=_fake_comm()), "gloo")
    with pytest.raises(transports.TransportUnsupported, match="gloo sends and receives only host memory"):
        gloo.post_p2p(None, e, buf, 1, None)
    with pytest.raises(transports.TransportUnsupported):
        gloo.post_p2p(None, e, buf, 1, [])
    assert posted == []


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
    dump = str(lower(overlap.allgather_matmul(2).fusion, rank=0, backend="gloo", schedule=sched).program)
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
        return str(lower(overlap.allgather_matmul(2).fusion, rank=rank, backend="gloo", schedule=Schedule(transport="gloo")).program)

    plain = ring()
    assert "symmetric" not in plain and "into=" not in plain
    from hostir import backends

    declared_gloo = dataclasses.replace(
        backends.BACKENDS["gloo"], capabilities=transports.Capabilities(one_sided=True, needs_symmetric_buffers=True)
    )
    monkeypatch.setitem(backends.BACKENDS, "gloo", declared_gloo)
    declared = ring()
    assert "symmetric" in declared and "into=" in declared, declared


def test_a_new_program_never_finds_a_dead_programs_windows(monkeypatch):
    # Windows are per program, held weakly: a program made where a dead
    # one was (the same id()) rendezvous for windows of its own on every
    # rank, never reusing the dead one's on some ranks only.
    import gc

    made = []

    class FakeWindow:
        def __init__(self, nbytes, device, group):
            made.append(self)
            self.base, self.nbytes = 4096 * len(made), nbytes

        def view(self, rank, shape, dtype, byte_off):
            return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(cuda, "SymmetricWindow", FakeWindow)
    transport = object.__new__(cuda.CudaTransport)
    transport.comm = types.SimpleNamespace(rank=0)
    transport.device = torch.device("cpu")
    transport.group_name = "world"
    transport.kind = "symm_mem"
    transport.rendezvous_count = 0
    transport._windows = cuda.weakref.WeakKeyDictionary()

    def frame_of(container, parity=0):
        return types.SimpleNamespace(call_parity=parity, evaluator=types.SimpleNamespace(container=container))

    c = HostIrContainer()
    tv = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.symmetric)
    first = HostIrContainer()
    transport.allocate(frame_of(first), tv, [4])
    transport.allocate(frame_of(first), tv, [4])  # the same call parity: the same window
    transport.allocate(frame_of(first, 1), tv, [4])  # the other parity: its own
    assert transport.rendezvous_count == 2 and len(transport._windows) == 1
    del first
    gc.collect()
    assert len(transport._windows) == 0
    transport.allocate(frame_of(HostIrContainer()), tv, [4])
    assert transport.rendezvous_count == 3 and len(made) == 3
