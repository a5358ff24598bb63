"""Training through `hostir.parallel.parallelize_module` on models nobody
here wrote, against the same models unsharded, in float32.

- Hugging Face `LlamaForCausalLM` from a small `LlamaConfig` with random
  weights, parallelized by the model's own `base_model_tp_plan` (colwise
  q/k/v/gate/up, rowwise o/down);
- a Llama-like block written here, parallelized by a torchtitan-style
  sequence-parallel plan (SequenceParallel norms, PrepareModuleInput, the
  rowwise outputs sharded on the sequence), and the Megatron form of the
  same plan where the colwise layers take the sequence-sharded activations
  and hostir gathers them.

Each compares logits (or outputs), the loss, every parameter's gradient,
and the losses of several optimizer steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from hostir import DeviceMesh
from hostir.parallel import ParallelizeError, parallelize_module

TOL = {"rtol": 1e-4, "atol": 1e-5}
STEPS = 3


@pytest.fixture
def tp_mesh(world, device):
    return DeviceMesh(range(world.size)).to_torch(device.type)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_grads(model, ref):
    ours = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert ours[name].grad is not None, name
        torch.testing.assert_close(full(ours[name].grad), p.grad, **TOL, msg=lambda m: f"{name}: {m}")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        # 12 heads and 48 features divide among 2, 3 and 4 ranks alike.
        hidden_size=48,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return config, LlamaForCausalLM(config).float()


def test_llama_with_its_own_tp_plan(world, device, tp_mesh):
    config, model = tiny_llama()
    model.to(device)
    ref = copy.deepcopy(model)
    parallelize_module(model.model, tp_mesh, dict(config.base_model_tp_plan))
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    assert model.model.layers[0].self_attn.q_proj.weight.placements == (Shard(0),)
    assert model.model.layers[0].mlp.down_proj.weight.placements == (Shard(1),)

    ids = torch.randint(0, config.vocab_size, (2, 8), device=device)
    out = model(input_ids=ids, labels=ids)
    expected = ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, expected.logits, **TOL)
    torch.testing.assert_close(out.loss, expected.loss, **TOL)
    out.loss.backward()
    expected.loss.backward()
    compare_grads(model, ref)
    # Gradients are DTensors placed as their parameters.
    for layer in model.model.layers:
        for linear in (layer.self_attn.q_proj, layer.mlp.down_proj):
            assert isinstance(linear.weight.grad, DTensor)
            assert linear.weight.grad.placements == linear.weight.placements

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for _ in range(STEPS):
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        ref_loss.backward()
    # The state dict holds the DTensors torch's TP makes.
    state = model.state_dict()
    assert isinstance(state["model.layers.1.mlp.up_proj.weight"], DTensor)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim=48, heads=12, hidden=96):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Stack(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def torchtitan_plan(gather_in_hostir: bool) -> dict:
    """torchtitan's per-block plan; with `gather_in_hostir` the colwise
    layers take the sequence-sharded activations themselves (Megatron's
    form), so hostir gathers them, instead of PrepareModuleInput."""
    plan = {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    colwise = ColwiseParallel(input_layouts=Shard(1)) if gather_in_hostir else ColwiseParallel()
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[name] = colwise
    if not gather_in_hostir:
        plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


@pytest.mark.parametrize("gather_in_hostir", [False, True], ids=["torchtitan", "megatron"])
def test_sequence_parallel_llama_block(world, device, tp_mesh, gather_in_hostir):
    model = Stack().to(device)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, torchtitan_plan(gather_in_hostir))
    S = 4 * world.size
    x = torch.randn(2, S, 48, device=device)
    target = torch.randn(2, S, 48, device=device)
    mine = x.chunk(world.size, 1)[world.rank]
    my_target = target.chunk(world.size, 1)[world.rank]

    def loss_of(y, t):
        return ((y - t) ** 2).sum()

    y = model(mine)
    expected = ref(x)
    torch.testing.assert_close(y, expected.chunk(world.size, 1)[world.rank], **TOL)
    # Each rank's loss is its slice of the sequence's; their sum is the whole loss.
    loss_of(y, my_target).backward()
    loss_of(expected, target).backward()
    compare_grads(model, ref)

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    for _ in range(STEPS):
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = loss_of(model(mine), my_target)
        ref_loss = loss_of(ref(x), target)
        whole = loss.detach().clone()
        torch.distributed.all_reduce(whole)
        torch.testing.assert_close(whole, ref_loss.detach(), **TOL)
        loss.backward()
        ref_loss.backward()


def test_a_linear_style_on_another_module_is_refused_before_anything_moves(world, device, tp_mesh):
    model = Stack(layers=1).to(device)
    before = model.layers[0].attention_norm.weight
    with pytest.raises(ParallelizeError, match=r"module 'layers.0.attention_norm' \(RMSNorm\) under ColwiseParallel"):
        parallelize_module(model, tp_mesh, {"layers.*.attention.wq": ColwiseParallel(), "layers.*.attention_norm": ColwiseParallel()})
    assert model.layers[0].attention_norm.weight is before
    assert not isinstance(model.layers[0].attention.wq.weight, DTensor)


def test_dtensor_outputs_and_prepare_module_output(world, device, tp_mesh):
    """use_local_output=False returns the DTensor; PrepareModuleOutput
    redistributes it (here to replicated) as torch does."""
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    model = FeedForward(16, 8 * world.size).to(device)
    ref = copy.deepcopy(model)
    plan = {
        "w1": ColwiseParallel(),
        "w3": ColwiseParallel(),
        "w2": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
        "": PrepareModuleOutput(output_layouts=(Shard(0),), desired_output_layouts=(Replicate(),)),
    }
    parallelize_module(model, tp_mesh, plan)
    x = torch.randn(2 * world.size, 16, device=device)
    y = model(x)
    assert isinstance(y, torch.Tensor) and not isinstance(y, DTensor)
    expected = ref(x)
    torch.testing.assert_close(y, expected, **TOL)
    y.square().sum().backward()
    expected.square().sum().backward()
    compare_grads(model, ref)
