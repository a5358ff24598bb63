"""Colwise siblings that read one input run as one program
(`hostir.parallel._Group`): attention's q, k and v and an MLP's gate and up,
under the tensor-parallel plan and the sequence-parallel one where hostir
gathers the activation. Each test compares against the same module
unsharded (outputs, every gradient, optimizer steps) and counts how the
members ran: armed, no member runs a program of its own; where the parent
does not call them on one input, each runs alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from hostir import DeviceMesh, parallel
from hostir.parallel import parallelize_module

from .test_llama_tp import Attention, RMSNorm

TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture
def tp_mesh(world, device):
    return DeviceMesh(range(world.size)).to_torch(device.type)


@pytest.fixture
def alone(monkeypatch):
    """The colwise members' calls that ran a program of their own."""
    calls = []
    original = parallel._Linear.__call__

    def counted(self, module, x):
        if self.kind == "colwise":
            calls.append(self.name)
        return original(self, module, x)

    monkeypatch.setattr(parallel._Linear, "__call__", counted)
    return calls


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_grads(model, ref):
    ours = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert ours[name].grad is not None, name
        torch.testing.assert_close(full(ours[name].grad), p.grad, **TOL, msg=lambda m: f"{name}: {m}")


def step_like_torch(world, model, ref, *inputs) -> None:
    """One forward and backward of `model` (colwise outputs: this rank's
    columns) against `ref` on the same inputs: outputs, then gradients; the
    gradients cleared after."""
    y, expected = model(*inputs), ref(*inputs)
    torch.testing.assert_close(y, expected.chunk(world.size, -1)[world.rank], **TOL)
    grad = torch.randn_like(expected)
    y.backward(grad.chunk(world.size, -1)[world.rank])
    expected.backward(grad)
    compare_grads(model, ref)
    for p in (*model.parameters(), *ref.parameters()):
        p.grad = None


class MLP(nn.Module):
    def __init__(self, dim=48, hidden=96, bias=False):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=bias), nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        # A key's bias has no gradient through softmax (it adds one number to
        # a query's scores): biased siblings are the MLP's.
        self.attention_norm, self.attention = RMSNorm(48), Attention(48, 12)
        self.mlp_norm, self.mlp = RMSNorm(48), MLP(bias=bias)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.mlp(self.mlp_norm(h))


def plan(sp: bool) -> dict:
    colwise = (lambda: ColwiseParallel(input_layouts=Shard(1))) if sp else ColwiseParallel
    rowwise = (lambda: RowwiseParallel(output_layouts=Shard(1))) if sp else RowwiseParallel
    entries = {
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(),
        "mlp.gate": colwise(),
        "mlp.up": colwise(),
        "mlp.down": rowwise(),
    }
    if sp:
        entries.update({"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
    return entries


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_siblings_run_as_one_program_and_train_as_torch(world, device, tp_mesh, alone, sp, bias):
    torch.manual_seed(0)
    model = nn.Sequential(Block(bias), Block(bias)).to(device)
    ref = copy.deepcopy(model)
    for block in model:
        parallelize_module(block, tp_mesh, plan(sp))
    groups = {id(m._hostir_linear.group) for block in model for m in (block.attention.wq, block.attention.wk)}
    assert len(groups) == 2 and model[0].attention.wv._hostir_linear.group is model[0].attention.wq._hostir_linear.group
    assert model[0].mlp.gate._hostir_linear.group is model[0].mlp.up._hostir_linear.group
    assert model[0].attention.wo._hostir_linear.group is None  # rowwise: alone
    S = 4 * world.size
    x, target = torch.randn(2, S, 48, device=device), torch.randn(2, S, 48, device=device)
    mine = x.chunk(world.size, 1)[world.rank] if sp else x
    my_target = target.chunk(world.size, 1)[world.rank] if sp else target

    def loss_of(y, t):
        return ((y - t) ** 2).sum()

    # One step for plain and DTensor parameters alike (torch's foreach kernels refuse the mix).
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3, foreach=False)
    for step in range(3):
        alone.clear()
        y = model(mine)
        expected = ref(x)
        torch.testing.assert_close(y, expected.chunk(world.size, 1)[world.rank] if sp else expected, **TOL)
        # The first call learns (every member alone); later ones run the groups.
        assert len(alone) == (10 if step == 0 else 0), alone
        assert all(m._hostir_linear.group.state == "armed" for block in model for m in (block.attention.wq, block.mlp.up))
        loss_of(y, my_target).backward()
        loss_of(expected, target).backward()
        compare_grads(model, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # The optimizer stepped the weights in place: the backward's
    # concatenated weight is still the members' shared buffer, no copy.
    for block in model:
        for members in ((block.attention.wq, block.attention.wk, block.attention.wv), (block.mlp.gate, block.mlp.up)):
            group = members[0]._hostir_linear.group
            assert group.concatenated([m.weight.to_local() for m in members]) is group.weights


def test_a_weight_moved_off_the_shared_buffer_is_copied_into_place(world, device, tp_mesh):
    torch.manual_seed(4)
    model = Block().to(device)
    ref = copy.deepcopy(model)
    parallelize_module(model, tp_mesh, plan(False))
    # A new tensor for k's weight (as loading one would make): the group
    # concatenates the weights, and still computes k with the new values.
    k = model.attention.wk.weight
    fresh = DTensor.from_local(k.to_local().clone() * 2, k.device_mesh, k.placements, run_check=False)
    model.attention.wk.weight = nn.Parameter(fresh)
    with torch.no_grad():
        ref.attention.wk.weight.mul_(2)
    group = model.attention.wq._hostir_linear.group
    members = (model.attention.wq, model.attention.wk, model.attention.wv)
    assert group.concatenated([m.weight.to_local() for m in members]) is not group.weights
    x = torch.randn(2, 4, 48, device=device)
    for _ in range(2):
        y, expected = model(x), ref(x)
        torch.testing.assert_close(y, expected, **TOL)
        y.sum().backward()
        expected.sum().backward()
        compare_grads(model, ref)
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
    assert group.state == "armed"


def test_grouping_can_be_turned_off(world, device, tp_mesh, alone):
    model = Block().to(device)
    parallelize_module(model, tp_mesh, plan(False), group_siblings=False)
    assert model.attention.wq._hostir_linear.group is None
    x = torch.randn(2, 4, 48, device=device)
    model(x)
    model(x)
    assert len(alone) == 10


class Cross(nn.Module):
    """Cross-attention's projections: q reads one input, k and v another."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(24, 24, bias=False) for _ in range(3))

    def forward(self, x, memory):
        return self.q(x) * self.k(memory) + self.v(memory)


def test_siblings_on_different_inputs_each_run_alone(world, device, tp_mesh, alone):
    torch.manual_seed(1)
    model = Cross().to(device)
    ref = copy.deepcopy(model)
    parallelize_module(model, tp_mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()})
    x, memory = torch.randn(4, 24, device=device), torch.randn(4, 24, device=device)
    for _ in range(2):
        step_like_torch(world, model, ref, x, memory)
    assert model.q._hostir_linear.group.state == "off"
    assert len(alone) == 6


class Optional(nn.Module):
    """Reads v only when asked."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(24, 24, bias=False) for _ in range(3))

    def forward(self, x, with_v=True):
        y = self.q(x) + self.k(x)
        return y + self.v(x) if with_v else y


def test_an_armed_group_whose_output_goes_unread_turns_off(world, device, tp_mesh, alone):
    torch.manual_seed(2)
    model = Optional().to(device)
    ref = copy.deepcopy(model)
    parallelize_module(model, tp_mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()})
    x = torch.randn(4, 24, device=device)
    group = model.q._hostir_linear.group
    for with_v, state, ran_alone in ((True, "armed", 3), (True, "armed", 0), (False, "off", 0), (False, "off", 2)):
        alone.clear()
        y = model(x, with_v)
        torch.testing.assert_close(y, ref(x, with_v).chunk(world.size, -1)[world.rank], **TOL)
        assert (group.state, len(alone)) == (state, ran_alone)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(24, 24, bias=False), nn.Linear(24, 24, bias=False)

    def forward(self, x):
        k = self.k(x)
        k.mul_(2.0)
        return self.q(x) * k


def test_a_grouped_output_changed_in_place_keeps_its_gradients(world, device, tp_mesh):
    torch.manual_seed(3)
    model = InPlace().to(device)
    ref = copy.deepcopy(model)
    parallelize_module(model, tp_mesh, {"q": ColwiseParallel(), "k": ColwiseParallel()})
    x = torch.randn(4, 24, device=device)
    for _ in range(2):
        step_like_torch(world, model, ref, x)
    assert model.q._hostir_linear.group.state == "armed"
