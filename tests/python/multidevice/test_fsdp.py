"""FSDP-style programs under mpirun: a stack of linear layers whose weights
are sharded on mesh_x and all-gathered before use. Layer l+1's Allgather is
posted before layer l computes (the program's dump is the golden one made
by tests/python/test_fsdp_lowering.py, race-free), and the result matches
eager torch on the whole weights for every hoisting choice. Trained
data-parallel (each rank its rows of the batch), the backward re-gathers
each weight and reduce-scatters its gradient under the next layer's
backward, and every rank's gradients match eager torch's."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import hostir

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fsdp_programs import BATCH, H, fsdp_mlp, fsdp_training_mlp, reference  # noqa: E402

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
    golden = GOLDEN / f"fsdp_mlp_np{world.size}.hir"
    if not golden.exists():
        pytest.skip(f"no golden FSDP dump for {world.size} ranks")
    # The goldens name the gloo backend; under NCCL the same program names NCCL.
    expected = golden.read_text().replace("backend=gloo", f"backend={lowered.backend}")
    assert str(lowered.program) == expected
    assert str(fd.host_program()) == expected
    assert hostir.check_races(lowered.program, lowered.rank) == []


def test_fsdp_stack_calls_repeat(world, device):
    fd = fsdp_mlp(world.size, layers=4)
    x, ws, inputs = _pieces(world, device, layers=4)
    for _ in range(3):
        (out,) = fd.execute(inputs, hoist="hoist")
    torch.testing.assert_close(out.cpu(), reference(x, ws), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hoist", ["auto", "hoist", "sequential"])
def test_fsdp_training_gradients_match_eager_torch(world, device, hoist):
    # In float64: the weight gradients sum the ranks' partial sums in
    # another order than torch, which float32 rounds apart.
    D, r, layers = world.size, world.rank, 3
    f64 = torch.float64
    x, g = torch.randn(BATCH, H, dtype=f64), torch.randn(BATCH, H, dtype=f64)
    ws = [torch.randn(H, H, dtype=f64) for _ in range(layers)]
    fd = fsdp_training_mlp(D, layers, dtype=f64)
    mine_x = x.chunk(D, 0)[r].clone().to(device).requires_grad_()
    mine_ws = [w.chunk(D, 0)[r].clone().to(device).requires_grad_() for w in ws]
    (y,) = fd.execute([mine_x, *mine_ws], hoist=hoist)
    y.backward(g.chunk(D, 0)[r].to(device))

    whole_x = x.clone().requires_grad_()
    whole_ws = [w.clone().requires_grad_() for w in ws]
    expected = reference(whole_x, whole_ws)
    expected.backward(g)
    torch.testing.assert_close(y.detach().cpu(), expected.detach().chunk(D, 0)[r])
    torch.testing.assert_close(mine_x.grad.cpu(), whole_x.grad.chunk(D, 0)[r])
    for mine, whole in zip(mine_ws, whole_ws):
        # Each rank's rows of the weight gradient: summed over every rank's batch rows.
        torch.testing.assert_close(mine.grad.cpu(), whole.grad.chunk(D, 0)[r])


def test_fsdp_backward_reduce_scatters_under_the_next_layers_backward(world, device):
    from hostir.autograd import training_of

    D, r, layers = world.size, world.rank, 3
    fd = fsdp_training_mlp(D, layers)
    x = torch.randn(BATCH, H).chunk(D, 0)[r].to(device).requires_grad_()
    ws = [torch.randn(H, H).chunk(D, 0)[r].to(device).requires_grad_() for _ in range(layers)]
    (y,) = fd.execute([x, *ws], hoist="hoist")
    y.sum().backward()
    backward = training_of(fd, tuple(range(layers + 1))).backward.host_program()
    scatters = [e for e in backward.exprs if isinstance(e, hostir.ir.Communication) and e.type.value == "ReduceScatter"]
    assert len(scatters) == layers
    assert all("waited for" in e.schedule for e in scatters[:-1]), [e.schedule for e in scatters]
    assert hostir.check_races(backward, world.rank) == []
