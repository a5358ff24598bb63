"""The copy-engine (`cuda`) transport's programs in the C++ executor, on
the CPU: the flat programs of ring decompositions with transport=cuda
(golden dumps: symmetric Allocates, chunk views, pushes naming their place
in the peer's window), the runner choosing the C++ executor for them, the
chunk views against the Python evaluator, and the clear error a cuda
instruction gives where there is no CUDA. The same programs run on GPUs in
tests/python/multidevice/test_cuda_transport_cpp.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from conftest import check_golden
from hostir import FusionDefinition, ParallelType, cpp, overlap
from hostir.lower import lower
from hostir.lower.schedule import Schedule
from hostir.runtime import flat
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.transports.base import TransportUnsupported

needs_cpp = pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}")

RINGS = {
    "ag_ring_cuda": (overlap.allgather_matmul, Schedule("ring", 1, 1, "cuda")),
    "ag_ring_chunks2_reverse_cuda": (overlap.allgather_matmul, Schedule("ring", 2, -1, "cuda")),
    "rs_ring_cuda": (overlap.matmul_reduce_scatter, Schedule("ring", 1, 1, "cuda")),
    "rs_ring_chunks2_cuda": (overlap.matmul_reduce_scatter, Schedule("ring", 2, 1, "cuda")),
}


def _comm(rank: int = 0, world_size: int = 2):
    """What the flat compiler asks of a communicator for P2P-only programs."""
    return types.SimpleNamespace(rank=rank, world_size=world_size, group=lambda key: None, group_order=list)


def _program(name: str):
    make, schedule = RINGS[name]
    return lower(make(2).fusion, rank=0, backend="gloo", schedule=schedule).program


@pytest.fixture
def one_rank_group():
    """A default process group (of one rank) for the flat program's P2P group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(RINGS))
def test_flat_program_of_a_cuda_ring(name):
    check_golden(f"flat_{name}", flat.compile_program(_program(name), _comm(), 0).dump())


@pytest.mark.parametrize("name", sorted(RINGS))
def test_a_cuda_ring_runs_in_cpp(name):
    assert flat.unsupported_reasons(_program(name)) == []


def test_a_push_names_its_place_in_the_peers_window():
    program = flat.compile_program(_program("ag_ring_chunks2_reverse_cuda"), _comm(), 0)
    sends = [i for i in program.instrs if i.op == "p2p" and i.fields["send"]]
    recvs = [i for i in program.instrs if i.op == "p2p" and not i.fields["send"]]
    assert sends and recvs
    assert all(i.fields["backend"] == "cuda" and i.fields["into"] >= 0 for i in sends)
    assert all("into" not in i.fields for i in recvs)
    windows = [i for i in program.instrs if i.op == "allocate" and i.fields.get("symmetric")]
    assert len(windows) == 1
    # The push lands in a chunk of the window, the receive reads one.
    chunks = {i.fields["out"]: i for i in program.instrs if i.op == "chunk"}
    assert sends[0].fields["into"] in chunks and recvs[0].fields["buffer"] in chunks


@needs_cpp
def test_a_cuda_instruction_without_cuda_is_a_clear_error(one_rank_group):
    evaluator = cpp.CppEvaluator(_program("ag_ring_cuda"), device="cpu", communicator=_comm(), rank=0)
    x, w = torch.randn(1, 4, 6), torch.randn(6, 5)
    with pytest.raises(
        TransportUnsupported, match="the cuda transport moves data between CUDA devices, but this program runs on cpu"
    ):
        evaluator.run_tensors([x, w], [], 2)


def _split_loop():
    """y = 2 * x, y's rows split into 3 walked by a stream loop: a chunk
    view of x and of y per iteration (HirAliasSelects of the split's outer
    piece)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4])
        y = fd.ops.mul(x, 2.0)
        fd.add_output(y)
    y.outer_split(0, 3)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


@needs_cpp
@pytest.mark.parametrize("rows", [6, 7, 2])
def test_chunk_views_match_the_python_evaluator(rows):
    fd = _split_loop()
    program = lower(fd.fusion).program
    assert any(i.op == "chunk" for i in flat.compile_program(program).instrs), flat.compile_program(program).dump()
    x = torch.randn(rows, 4)
    expected = HostIrEvaluator(program).run({program.inputs[0]: x})
    got = cpp.CppEvaluator(program).run({program.inputs[0]: x})
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[0], 2 * x)


def test_windows_are_not_made_where_the_transport_cannot_run():
    from hostir.runtime.transports import cuda

    comm = types.SimpleNamespace(rank=0, world_size=2)
    with pytest.raises(TransportUnsupported, match="the cuda transport cannot run here: the ranks run on cpu"):
        cuda.provide_windows(None, _program("ag_ring_cuda"), comm, torch.device("cpu"), "0:96")
