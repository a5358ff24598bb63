"""Expert parallelism: `hostir.moe.MoELayer` and `hostir.parallel`'s
`ExpertParallel` against the same layers unsharded, in float32.

- the layer itself (route, dispatch AllToAll, batched expert matmuls,
  combine AllToAll), outputs and every gradient, against a loop over
  tokens and choices; with a capacity that drops pairs, against the same
  loop dropping them; its forward and backward programs' AllToAlls;
- Hugging Face `Qwen2MoeSparseMoeBlock` and `MixtralSparseMoeBlock` from
  small configs with random weights, their `experts` under
  `ExpertParallel`: outputs, gradients and a few optimizer steps against
  the unsharded block run on every rank's tokens.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hostir import DeviceMesh, backends, ir
from hostir.autodiff import derive
from hostir.executor import FusionExecutor
from hostir.lower import lower
from hostir.lower.schedule import parse as parse_schedule
from hostir.moe import MoELayer
from hostir.parallel import ExpertParallel, ParallelizeError, parallelize_module

TOL = {"rtol": 1e-4, "atol": 1e-5}
STEPS = 3


def kwargs(device):
    return {"backend": "gloo"} if device.type == "cpu" else {}


def routed(D, T, H, E, k, device):
    """Every rank's tokens [D, T, H] and a router's choices for them."""
    x = torch.randn(D, T, H, device=device)
    probs = torch.softmax(x @ torch.randn(E, H, device=device).T, -1)
    weights, indices = torch.topk(probs, k)
    return x, indices, weights / weights.sum(-1, keepdim=True)


def reference(x, indices, weights, gate, up, down, capacity=None):
    """The layer token by token; a pair past `capacity` (counted per
    source rank and expert, in token order) contributes nothing."""
    D, T, _ = x.shape
    k = indices.shape[-1]
    out = torch.zeros_like(x)
    for d in range(D):
        used = {}
        for t in range(T):
            for j in range(k):
                e = int(indices[d, t, j])
                used[e] = used.get(e, 0) + 1
                if capacity is not None and used[e] > capacity:
                    continue
                h = torch.nn.functional.silu(gate[e] @ x[d, t]) * (up[e] @ x[d, t])
                out[d, t] = out[d, t] + weights[d, t, j] * (down[e] @ h)
    return out


def rank_inputs(r, El, x, weights, gate, up, down, fused):
    """Rank r's tokens, routing weights and experts' weights, as leaves:
    gate and up apart, or (`fused`) as one gate_up [El, 2F, H]."""
    experts = [w[r * El : (r + 1) * El] for w in (gate, up, down)]
    if fused:
        experts = [torch.cat(experts[:2], 1), experts[2]]
    return [t.clone().requires_grad_() for t in [x[r], weights[r], *experts]]


def check_grads(r, El, mine, whole, fused):
    """Every gradient of rank r's leaves against the unsharded layer's
    (`whole`: x, weights, gate, up, down)."""
    torch.testing.assert_close(mine[0].grad, whole[0].grad[r], **TOL)
    torch.testing.assert_close(mine[1].grad, whole[1].grad[r], **TOL)
    theirs = [w.grad[r * El : (r + 1) * El] for w in whole[2:]]
    if fused:
        theirs = [torch.cat(theirs[:2], 1), theirs[2]]
    for ours, t in zip(mine[2:], theirs):
        torch.testing.assert_close(ours.grad, t, **TOL)


@pytest.mark.parametrize("fused", [False, True], ids=["gate_up_apart", "gate_up_fused"])
@pytest.mark.parametrize("capacity", [None, 2])
def test_layer_matches_the_unsharded_layer(world, device, capacity, fused):
    D, r = world.size, world.rank
    T, H, F, E, k = 7, 8, 12, 2 * D, 2
    El = E // D
    x, indices, weights = routed(D, T, H, E, k, device)
    gate, up = torch.randn(E, F, H, device=device) / 3, torch.randn(E, F, H, device=device) / 3
    down = torch.randn(E, H, F, device=device) / 3
    whole = [t.clone().requires_grad_() for t in (x, weights, gate, up, down)]
    expected = reference(whole[0], indices, *whole[1:], capacity=capacity)
    mine = rank_inputs(r, El, x, weights, gate, up, down, fused)
    layer = MoELayer(DeviceMesh(range(D)), E, capacity=capacity, **kwargs(device))
    out = layer(mine[0], indices[r], *mine[1:])
    torch.testing.assert_close(out, expected[r], **TOL)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out.backward(grad[r])
    check_grads(r, El, mine, whole, fused)


def reference_exact(x, indices, weights, gate, up, down, bound):
    """The layer token by token where each source rank sends each peer at
    most `bound` pairs, packed by expert (a pair past them, counted in
    expert order, then token order, contributes nothing)."""
    D, T, _ = x.shape
    k, E = indices.shape[-1], gate.shape[0]
    El = E // D
    out = torch.zeros_like(x)
    for d in range(D):
        pairs = sorted(((int(indices[d, t, j]), t, j) for t in range(T) for j in range(k)))
        sent = {}
        for e, t, j in pairs:
            peer = e // El
            sent[peer] = sent.get(peer, 0) + 1
            if sent[peer] > bound:
                continue
            h = torch.nn.functional.silu(gate[e] @ x[d, t]) * (up[e] @ x[d, t])
            out[d, t] = out[d, t] + weights[d, t, j] * (down[e] @ h)
    return out


# HOSTIR_TEST_TRANSPORT=cuda runs the rings over the copy-engine transport
# (tools/gpu_check.py --part suite does, on the GPU machines).
RING_TRANSPORT = f":transport={os.environ['HOSTIR_TEST_TRANSPORT']}" if os.environ.get("HOSTIR_TEST_TRANSPORT") else ""


@pytest.mark.parametrize("fused", [False, True], ids=["gate_up_apart", "gate_up_fused"])
@pytest.mark.parametrize("walked", [None, "ring" + RING_TRANSPORT, "sequential"], ids=["sized", "walked", "unsized"])
@pytest.mark.parametrize("capacity", [None, 3])
def test_exact_layer_matches_the_unsharded_layer(world, device, capacity, walked, fused):
    """The exact form: counts exchanged first, then only the real rows
    (sized at run time), grouped GEMMs over them; walked (`overlap`), a
    ring of whole pieces of the bound's rows, grouped GEMMs over each
    piece's real rows (or, `sequential`, those pieces in one AllToAll
    each way). Outputs and every gradient as the unsharded layer, and
    with a bound that drops pairs as the same loop dropping them."""
    D, r = world.size, world.rank
    T, H, F, E, k = 7, 8, 12, 2 * D, 2
    El = E // D
    x, indices, weights = routed(D, T, H, E, k, device)
    gate, up = torch.randn(E, F, H, device=device) / 3, torch.randn(E, F, H, device=device) / 3
    down = torch.randn(E, H, F, device=device) / 3
    whole = [t.clone().requires_grad_() for t in (x, weights, gate, up, down)]
    bound = T * k if capacity is None else capacity
    expected = reference_exact(whole[0], indices, *whole[1:], bound=bound)
    mine = rank_inputs(r, El, x, weights, gate, up, down, fused)
    walk = {"overlap": True, "schedule": walked} if walked else {}
    layer = MoELayer(DeviceMesh(range(D)), E, capacity=capacity, exact=True, **walk, **kwargs(device))
    out = layer(mine[0], indices[r], *mine[1:])
    torch.testing.assert_close(out, expected[r], **TOL)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out.backward(grad[r])
    check_grads(r, El, mine, whole, fused)


def test_exact_exchanges_are_sized_by_counts_forward_and_backward(world, device):
    """The exact form's programs: an AllToAll of the counts, then the
    token and result AllToAlls sized by them (`rows=`), the experts as
    grouped GEMMs; the backward sends the same two ways back, sized by
    the same counts swapped, and its weights' gradients are grouped outer
    products."""
    D = world.size
    layer = MoELayer(DeviceMesh(range(D)), 2 * D, exact=True, **kwargs(device))
    fd = layer.fusion(6, 2, 8, 12, torch.float32)
    forward = fd.host_ir()
    comms = [line for line in forward.splitlines() if "type=AllToAll" in line]
    assert len(comms) == 3, forward
    assert sum("rows=" in line for line in comms) == 2, forward
    assert forward.count("grouped_mm(") == 3 and "route_counts(" in forward, forward
    backward = FusionExecutor(derive(fd.fusion, [0, 2, 3, 4, 5]).backward).host_ir()
    comms = [line for line in backward.splitlines() if "type=AllToAll" in line]
    assert len(comms) == 2 and all("rows=" in line for line in comms), backward
    assert backward.count("grouped_outer(") == 3, backward


def test_exact_form_walked_is_one_ring_forward_and_backward(world, device):
    """The exact form walked: the counts are the one AllToAll, before the
    ring; each step moves a whole piece (no `rows=`) and runs the three
    grouped GEMMs on it. The backward reads the saved counts, walks the
    same ring (each step returns the tokens' gradients) and makes the
    weights' gradients (grouped outer products) after it."""
    D = world.size
    layer = MoELayer(DeviceMesh(range(D)), 2 * D, exact=True, overlap=True, capacity_factor=1.5)
    fd = layer.fusion(6, 2, 8, 12, torch.float32)
    backward = derive(fd.fusion, [0, 2, 3, 4, 5]).backward
    for fusion, counts_exchanged, outers in ((fd.fusion, 1, 0), (backward, 0, 3)):
        program = lower(fusion, rank=world.rank, backend="gloo", schedule=parse_schedule("ring")).program
        (ring,) = [e for e in program.exprs if isinstance(e, ir.ForLoop) and e.schedule]
        inside = list(ir.walk(ring.body))
        sends = [e for e in inside if isinstance(e, ir.P2PCommunication) and e.type == "send"]
        assert len(sends) == 2, program
        assert sum(isinstance(e, ir.GroupedMmOp) for e in inside) == 3, program
        assert not any(isinstance(e, ir.GroupedOuterOp) for e in inside), program
        assert sum(isinstance(e, ir.GroupedOuterOp) for e in program.walk()) == outers, program
        exchanges = [e for e in program.walk() if isinstance(e, ir.Communication)]
        assert len(exchanges) == counts_exchanged and "rows=" not in str(program), program


@pytest.mark.cuda
def test_exact_form_walked_replays_from_a_cuda_graph(world, device):
    """The exact form walked reads nothing on the host (the grouped GEMMs
    on torch's kernel, bfloat16 on compute capability 9.0 and up): its
    program is captured in CUDA graphs and each replay, on new tokens and
    routing copied into the captured inputs, gives the eager call's
    output."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("torch's grouped GEMM kernel: a GPU of compute capability 9.0 or more")
    from hostir.runtime import graphs

    D = world.size
    T, H, F, E, k = 64, 64, 32, 4 * D, 2
    schedule = "ring" + RING_TRANSPORT
    layer = MoELayer(DeviceMesh(range(D)), E, exact=True, overlap=True, capacity_factor=2.0, schedule=schedule)
    bf16 = torch.bfloat16

    def call():
        x, indices, weights = routed(1, T, H, E, k, device)
        return x[0].to(bf16), indices[0], weights[0].to(bf16)

    experts = [torch.randn(E // D, F, H, device=device, dtype=bf16) / 8 for _ in range(2)]
    experts.append(torch.randn(E // D, H, F, device=device, dtype=bf16) / 6)
    x, indices, weights = call()
    captured = [x, indices, weights.unsqueeze(-2), *experts]
    replay = graphs.capture(layer.fusion(T, k, H, F, bf16), [t.unsqueeze(0) for t in captured], schedule=schedule)
    for step in range(3):
        x, indices, weights = call()
        for buffer, new in zip(captured, (x, indices, weights.unsqueeze(-2))):
            buffer.copy_(new)
        (out,) = replay()
        expected = layer(x, indices, weights, *experts)
        torch.testing.assert_close(out.view(T, H), expected, msg=lambda m: f"replay {step}: {m}")


@pytest.mark.parametrize(
    "schedule", ["sequential", "ring" + RING_TRANSPORT, "ring:direction=-1" + RING_TRANSPORT.replace(":", ",")]
)
def test_dispatch_walked_as_a_ring_matches(world, device, schedule):
    """The experts walk the source ranks (`overlap`): each rank's tokens
    arrive in a ring of the dispatch's pieces, are computed as they land
    and go back in the same step; forward and backward as the layer
    without the walk."""
    D, r = world.size, world.rank
    T, H, F, E, k = 6, 8, 12, 4 * D, 2
    El = E // D
    x, indices, weights = routed(D, T, H, E, k, device)
    experts = [torch.randn(E, F, H, device=device), torch.randn(E, F, H, device=device)]
    experts.append(torch.randn(E, H, F, device=device))
    mine = [x[r], weights[r]] + [w[r * El : (r + 1) * El] / 3 for w in experts]
    ours = [t.clone().requires_grad_() for t in mine]
    plain = [t.clone().requires_grad_() for t in mine]
    mesh = DeviceMesh(range(D))
    walked = MoELayer(mesh, E, schedule=schedule, **kwargs(device))
    out = walked(ours[0], indices[r], *ours[1:])
    expected = MoELayer(mesh, E, overlap=False, **kwargs(device))(plain[0], indices[r], *plain[1:])
    torch.testing.assert_close(out, expected, **TOL)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a.grad, b.grad, **TOL)
    program = walked.fusion(T, k, H, F, torch.float32).host_ir(
        inputs=[t.unsqueeze(0) for t in (mine[0], indices[r], mine[1].unsqueeze(-2), *mine[2:])], schedule=schedule
    )
    backward = derive(walked.fusion(T, k, H, F, torch.float32).fusion, [0, 2, 3, 4, 5]).backward
    backend = backends.of_process_group("nccl" if device.type == "cuda" else "gloo").name
    backward = str(lower(backward, rank=r, backend=backend, schedule=parse_schedule(schedule)).program)
    for walk in (program, backward):
        if schedule == "sequential":
            assert walk.count("type=AllToAll") == 2
        else:
            # Dispatch and combine are one ring: each step receives a
            # peer's tokens (in the backward, the output's gradients), runs
            # the experts on them and sends the results (the tokens'
            # gradients) back.
            assert walk.count("type=AllToAll") == 0, walk
            assert "(ring, chunks=" in walk and walk.count("type=send") == 2, walk


@pytest.mark.parametrize("schedule", ["collective", "ring:chunks=2"])
def test_a_walked_dispatch_refuses_collectives_and_chunks(world, device, schedule):
    D = world.size
    layer = MoELayer(DeviceMesh(range(D)), 2 * D, schedule=schedule, **kwargs(device))
    x, indices, weights = routed(D, 4, 8, 2 * D, 2, device)
    experts = [torch.randn(2, 6, 8, device=device)] * 2 + [torch.randn(2, 8, 6, device=device)]
    with pytest.raises(Exception, match="a ring of one piece per peer or sequentially"):
        layer(x[world.rank], indices[world.rank], weights[world.rank], *experts)


def test_dispatch_and_combine_are_all_to_alls_forward_and_backward(world, device):
    D = world.size
    layer = MoELayer(DeviceMesh(range(D)), 2 * D, overlap=False, **kwargs(device))
    fd = layer.fusion(6, 2, 8, 12, torch.float32)
    forward = fd.host_ir()
    assert forward.count("type=AllToAll") == 2
    assert "route_slot(" in forward and "route_source(" in forward and "take(" in forward
    backward = FusionExecutor(derive(fd.fusion, [0, 2, 3, 4, 5]).backward).host_ir()
    # Combine's transpose dispatches the output's gradient, dispatch's
    # combines the tokens' gradients back: two AllToAlls; the combine's
    # take transposes into a put_add, the dispatch's (given each token's
    # slots, `inverse`) into a take of the slots summed over the choices.
    assert backward.count("type=AllToAll") == 2, backward
    assert backward.count("put_add(") == 1, backward
    assert backward.count("take(") == 1 and "reduction(" in backward, backward


def test_bad_calls_are_refused_before_any_communication(world, device):
    D = world.size
    layer = MoELayer(DeviceMesh(range(D)), 2 * D, **kwargs(device))
    x = torch.randn(5, 8, device=device)
    idx = torch.zeros(5, 2, dtype=torch.int64, device=device)
    w = torch.rand(5, 2, device=device)
    gate = torch.randn(2, 4, 8, device=device)
    down = torch.randn(2, 8, 4, device=device)
    with pytest.raises(Exception, match="indices must be int64"):
        layer(x, idx.float(), w, gate, gate, down)
    with pytest.raises(Exception, match="weights must be"):
        layer(x, idx, w[:4], gate, gate, down)
    with pytest.raises(Exception, match="down must be this rank's 2 experts"):
        layer(x, idx, w, gate, gate, down[:, :, :3])
    with pytest.raises(Exception, match="as gate, up, down or as gate_up, down; got 1 tensors"):
        layer(x, idx, w, gate)
    with pytest.raises(Exception, match=r"gate_up must be this rank's 2 experts, \[2, 4, 8\]"):
        layer(x, idx, w, torch.cat([gate, gate[:, :1]], 1), torch.randn(2, 8, 5, device=device))
    with pytest.raises(Exception, match=r"down must be this rank's 2 experts, \[2, 8, 4\]"):
        layer(x, idx, w, torch.cat([gate, gate], 1), down[:, :, :3])
    with pytest.raises(Exception, match="do not divide over"):
        MoELayer(DeviceMesh(range(D)), 2 * D + 1)
    for exact, overlap in ((False, None), (True, None), (True, True)):
        checked = MoELayer(
            DeviceMesh(range(D)), 2 * D, exact=exact, overlap=overlap, check_indices=True, **kwargs(device)
        )
        with pytest.raises(Exception, match=f"expert id {2 * D} in indices is outside \\[0, {2 * D}\\)"):
            checked(x, idx + 2 * D, w, gate, gate, down)
        with pytest.raises(Exception, match=r"expert id -1 in indices is outside"):
            checked(x, idx - 1, w, gate, gate, down)


# ------------------------------------------------------------ Hugging Face blocks


def qwen2_moe(E):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(
        hidden_size=16,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=20,
        num_experts=E,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return Qwen2MoeSparseMoeBlock(config)


def mixtral(E):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=E, num_experts_per_tok=2)
    return MixtralSparseMoeBlock(config)


def init(block):
    """Random weights in float64: three SGD steps of two different
    summation orders (the sharded experts' and the reference loop's) stay
    far inside the tolerance, which in float32 they may leave on a GPU."""
    block = block.double()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / 3)
    return block


def sum_local_grads(block):
    """Each rank's own gradients of the parameters outside the experts
    (the router, the shared expert), summed as data parallelism does."""
    for p in block.parameters():
        if p.grad is not None and not isinstance(p.grad, DTensor):
            dist.all_reduce(p.grad)


def parents_of_the_leaf(out: torch.Tensor, leaf: torch.Tensor) -> list[str]:
    """The autograd nodes whose gradients reach `leaf` through the node
    that reads it (its accumulator's parent, DTensor's `to_local`)."""
    seen, stack, edges = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                edges.append((node, child))
                stack.append(child)
    (accumulator,) = {c for _, c in edges if getattr(c, "variable", None) is leaf}
    readers = {n for n, c in edges if c is accumulator}
    return sorted(n.name() for n, c in edges if c in readers)


@pytest.mark.parametrize(
    "style",
    [{}, {"exact": True}, {"exact": True, "overlap": True, "schedule": "ring" + RING_TRANSPORT}],
    ids=["padded", "exact", "exact_walked"],
)
@pytest.mark.parametrize("make", [qwen2_moe, mixtral], ids=["qwen2_moe", "mixtral"])
def test_hugging_face_block_matches_unsharded(world, device, make, style):
    D, r = world.size, world.rank
    ref = init(make(2 * D)).to(device)
    block = copy.deepcopy(ref)
    mesh = DeviceMesh(range(D)).to_torch(device.type)
    parallelize_module(block, mesh, {"experts": ExpertParallel(**style)})
    assert isinstance(block.experts.gate_up_proj, DTensor)
    # One step per parameter: torch 2.11's foreach step refuses a list
    # mixing DTensors (the experts) and plain tensors (the router).
    opt = torch.optim.SGD(block.parameters(), lr=0.05, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, foreach=False)
    for step in range(STEPS):
        tokens = torch.randn(D, 3, 5, 16, device=device, dtype=torch.float64)
        out = block(tokens[r])
        expected = torch.cat([ref(tokens[d]) for d in range(D)]).view(D, 3, 5, 16)
        torch.testing.assert_close(out, expected[r], **TOL, msg=lambda m: f"step {step}: {m}")
        grad = torch.randn_like(expected)
        out.backward(grad[r])
        expected.backward(grad)
        if step == 0:
            # gate_up reaches the layer whole (only given the mesh axis):
            # the layer's program cuts it into gate and up, and its
            # backward joins their gradients (no split outside it).
            assert parents_of_the_leaf(out, block.experts.gate_up_proj) == ["UnsqueezeBackward0"]
        sum_local_grads(block)
        if step == 0:
            theirs = dict(ref.named_parameters())
            for name, p in block.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                torch.testing.assert_close(g, theirs[name].grad, **TOL, msg=lambda m: f"{name}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def test_expert_parallel_on_another_module_is_refused_before_anything_moves(world, device):
    block = init(qwen2_moe(2 * world.size)).to(device)
    mesh = DeviceMesh(range(world.size)).to_torch(device.type)
    with pytest.raises(ParallelizeError, match="apply the style to the block's `experts`"):
        parallelize_module(block, mesh, {"gate": ExpertParallel()})
    assert not isinstance(block.experts.gate_up_proj, DTensor)
