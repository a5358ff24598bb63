"""Golden dumps of the expert-parallel MoE layer's programs
(`hostir.moe.MoELayer`, run against torch under mpirun by
tests/python/multidevice/test_moe.py), lowered for rank 0 of 2: the
dispatch and combine as two AllToAlls (`sequential`), as one ring of sends
and receives over the source ranks on gloo and on the copy engine (each
piece pushed into the peer's symmetric buffer), and the backward. Each
dump is checked for stream races, and so is every mutant lacking one of
its synchronizations (`check_golden`)."""

from __future__ import annotations

import pytest
import torch

from conftest import check_golden
from hostir import DeviceMesh, ir
from hostir.autodiff import derive
from hostir.lower import lower
from hostir.lower.schedule import Schedule
from hostir.moe import MoELayer

# 2 ranks, 4 experts (2 each), 6 tokens of 2 choices, H 8, F 12.
SHAPE = dict(tokens=6, topk=2, hidden=8, ffn=12, dtype=torch.float32)


def layer(overlap: bool = True) -> MoELayer:
    return MoELayer(DeviceMesh(range(2)), 4, overlap=overlap)


@pytest.mark.parametrize(
    "name, overlap, sched",
    [
        ("moe_sequential", False, None),
        ("moe_ring", True, Schedule("ring")),
        ("moe_ring_cuda", True, Schedule("ring", transport="cuda")),
    ],
)
def test_golden_of_the_moe_layer(name, overlap, sched):
    fd = layer(overlap).fusion(**SHAPE)
    check_golden(name, lower(fd.fusion, rank=0, backend="gloo", schedule=sched))


def test_golden_of_the_moe_layers_training_forward_on_the_copy_engine():
    """The forward a training call runs returns what the backward reads
    (the received tokens, and the combined results for their shape): a
    symmetric window is written again two calls later, so each lands in a
    symmetric buffer of its own and is copied into the returned tensor."""
    fd = layer().fusion(**SHAPE)
    forward = derive(fd.fusion, [0, 2, 3, 4, 5]).forward
    lowered = lower(forward, rank=0, backend="gloo", schedule=Schedule("ring", transport="cuda"))
    returned = {id(t) for t in lowered.program.outputs}
    for e in lowered.program.walk():
        if isinstance(e, ir.Allocate) and id(e.buffer) in returned:
            assert e.memory_type is not ir.MemoryType.symmetric, e
    check_golden("moe_training_forward_ring_cuda", lowered)


def test_golden_of_the_moe_layers_backward():
    """Combine's transpose (the output gradient dispatched back to the
    experts' ranks), the experts' backward, dispatch's transpose (the
    tokens' gradients combined back): two AllToAlls, a put_add for each
    take, and nothing sent again for the saved received tokens."""
    fd = layer().fusion(**SHAPE)
    backward = derive(fd.fusion, [0, 2, 3, 4, 5]).backward
    check_golden("moe_backward", lower(backward, rank=0, backend="gloo"))
