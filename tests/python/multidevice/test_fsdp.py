"""FSDP-style programs under mpirun: a stack of linear layers whose weights
are sharded on mesh_x and all-gathered before use. Layer l+1's Allgather is
posted before layer l computes (the program's dump is the golden one made
by tests/python/test_fsdp_lowering.py, race-free), and the result matches
eager torch on the whole weights for every hoisting choice."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import hostir

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fsdp_programs import H, fsdp_mlp, reference  # noqa: E402

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"


def _pieces(world, device, layers: int = 3):
    x = torch.randn(5, H)
    ws = [torch.randn(H, H) for _ in range(layers)]
    mine = [w.chunk(world.size, 0)[world.rank].to(device) for w in ws]
    return x, ws, [x.to(device), *mine]


@pytest.mark.parametrize("hoist", ["hoist", "sequential", "auto", "hoist:lookahead=1"])
def test_fsdp_stack_matches_eager_torch(world, device, hoist):
    fd = fsdp_mlp(world.size)
    x, ws, inputs = _pieces(world, device)
    (out,) = fd.execute(inputs, hoist=hoist)
    torch.testing.assert_close(out.cpu(), reference(x, ws), rtol=1e-4, atol=1e-5)


def test_this_ranks_program_is_the_golden_one(world):
    fd = fsdp_mlp(world.size)
    lowered = fd.executor.lowered_program()
    if lowered.backend != "gloo":
        pytest.skip("the goldens name the gloo backend")
    golden = GOLDEN / f"fsdp_mlp_np{world.size}.hir"
    if not golden.exists():
        pytest.skip(f"no golden FSDP dump for {world.size} ranks")
    assert str(lowered.program) == golden.read_text()
    assert str(fd.host_program()) == golden.read_text()
    assert hostir.check_races(lowered.program, lowered.rank) == []


def test_fsdp_stack_calls_repeat(world, device):
    fd = fsdp_mlp(world.size, layers=4)
    x, ws, inputs = _pieces(world, device, layers=4)
    for _ in range(3):
        (out,) = fd.execute(inputs, hoist="hoist")
    torch.testing.assert_close(out.cpu(), reference(x, ws), rtol=1e-4, atol=1e-5)
