"""Golden dumps of the expert-parallel MoE layer's programs
(`hostir.moe.MoELayer`, run against torch under mpirun by
tests/python/multidevice/test_moe.py), lowered for rank 0 of 2: the
dispatch and combine as two AllToAlls (`sequential`), as one ring of sends
and receives over the source ranks on gloo and on the copy engine (each
piece pushed into the peer's symmetric buffer), and the backward. Each
dump is checked for stream races, and so is every mutant lacking one of
its synchronizations (`check_golden`)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import check_golden
from hostir import DeviceMesh, ir
from hostir.autodiff import derive
from hostir.lower import lower
from hostir.lower.schedule import Schedule
from hostir.moe import MoELayer
from hostir.runtime.fusion_ops import summed_products

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


@pytest.mark.parametrize(
    "name, sched", [("moe_backward", None), ("moe_backward_ring_cuda", Schedule("ring", transport="cuda"))]
)
def test_golden_of_the_moe_layers_backward(name, sched):
    """Combine's transpose (the output gradient dispatched back to the
    experts' ranks), the experts' backward, dispatch's transpose (the
    tokens' gradients combined back), walked as the forward is: one ring
    whose steps each receive a peer's output gradients, run the experts'
    backward on them and return the tokens' gradients to that peer; the
    weights' gradients read the walked tensors whole after the ring; a
    put_add for each take, and nothing sent again for the saved received
    tokens."""
    fd = layer().fusion(**SHAPE)
    backward = derive(fd.fusion, [0, 2, 3, 4, 5]).backward
    lowered = lower(backward, rank=0, backend="gloo", schedule=sched)
    (ring,) = [e for e in lowered.program.exprs if isinstance(e, ir.ForLoop) and e.schedule]
    sends = [e for e in ir.walk(ring.body) if isinstance(e, ir.P2PCommunication) and e.type == "send"]
    assert len(sends) == 2, "each step receives a peer's gradients and returns the tokens' gradients"
    assert not any(isinstance(e, ir.Communication) for e in lowered.program.walk())
    # The three weights' gradients, each a product per source rank summed
    # over the sources, run as one batched GEMM a source into the sum.
    sums = summed_products(lowered.program).sums.values()
    assert len(sums) == 3 and {id(r.out) for r in sums} <= {id(t) for t in lowered.program.outputs}
    check_golden(name, lowered)


def test_golden_of_the_exact_moe_layer_forward_and_backward():
    """The exact form: the per-expert counts exchanged first (an AllToAll
    of counts), then the tokens and the results sized by them (`rows=`,
    `rows_in=`), the experts as grouped GEMMs over the real rows; the
    backward sends the gradients the same two ways with the counts
    swapped, and the weights' gradients are grouped outer products."""
    fd = MoELayer(DeviceMesh(range(2)), 4, exact=True).fusion(**SHAPE)
    check_golden("moe_exact", lower(fd.fusion, rank=0, backend="gloo"))
    backward = derive(fd.fusion, [0, 2, 3, 4, 5]).backward
    check_golden("moe_exact_backward", lower(backward, rank=0, backend="gloo"))


def walked_exact() -> MoELayer:
    return MoELayer(DeviceMesh(range(2)), 4, exact=True, overlap=True, capacity_factor=1.5)


@pytest.mark.parametrize("sched", [Schedule("ring", transport="cuda")])
def test_golden_of_the_exact_moe_layer_walked(sched):
    """The exact form walked: the counts exchanged first (the one
    AllToAll), then the padded form's ring over whole pieces of B rows
    (no `rows=`: nothing read on the host), each step's experts three
    grouped GEMMs over the piece's rows, by the source rank's row of the
    counts; the backward walks the same ring on the saved counts and
    makes the weights' gradients (grouped outer products) after it."""
    fd = walked_exact().fusion(**SHAPE)
    check_golden("moe_exact_ring_cuda", lower(fd.fusion, rank=0, backend="gloo", schedule=sched))
    backward = derive(fd.fusion, [0, 2, 3, 4, 5]).backward
    check_golden("moe_exact_backward_ring_cuda", lower(backward, rank=0, backend="gloo", schedule=sched))


def test_golden_of_the_exact_moe_layer_walked_with_gate_up_fused():
    """gate and up as one weight (gate_up [E/D, 2F, H]): cut once into its
    halves (views of each rank's piece, before the walk), the steps as
    with two weights. The backward joins the two halves' output gradients
    in each step (one cat of [B, 2F] a piece) and runs one grouped GEMM
    by gate_up whole for the tokens' gradient (no sum of two) and, after
    the ring, one grouped outer product that is gate_up's gradient (no
    cat of the weights' size, no slice of gate_up, no insert into zeros)."""
    fd = walked_exact().fusion(**SHAPE, fused=True)
    sched = Schedule("ring", transport="cuda")

    def step(lowered) -> list:
        (ring,) = [e for e in lowered.program.exprs if isinstance(e, ir.ForLoop) and e.schedule]
        return list(ir.walk(ring.body))

    forward = lower(fd.fusion, rank=0, backend="gloo", schedule=sched)
    assert sum(isinstance(e, ir.GroupedMmOp) for e in step(forward)) == 3
    halves = [e for e in forward.program.exprs if isinstance(e, ir.SliceOp)]
    assert len(halves) == 2 and all(e.input in forward.program.inputs for e in halves)
    check_golden("moe_exact_fused_ring_cuda", forward)
    backward = lower(derive(fd.fusion, [0, 2, 3, 4]).backward, rank=0, backend="gloo", schedule=sched)
    every, in_step = list(backward.program.walk()), step(backward)
    # The output gradients of gate and up joined: the own piece's and a step's.
    cats = [e for e in every if isinstance(e, ir.CatOp)]
    assert len(cats) == 2 and sum(isinstance(e, ir.CatOp) for e in in_step) == 1
    assert all(c.out.logical_runtime()[-1].extent.value == 2 * SHAPE["ffn"] for c in cats)
    # A step's grouped GEMMs: down's and gate_up's (whole), no sum of two.
    assert sum(isinstance(e, ir.GroupedMmOp) for e in in_step) == 2
    assert not any(isinstance(e, ir.BinaryOp) and e.kind == "add" for e in every)
    assert not any(isinstance(e, (ir.InsertOp, ir.SliceOp)) for e in every)
    outers = [e for e in every if isinstance(e, ir.GroupedOuterOp)]
    assert sorted(o.out.logical_runtime()[-2].extent.value for o in outers) == [SHAPE["hidden"], 2 * SHAPE["ffn"]]
    check_golden("moe_exact_fused_backward_ring_cuda", backward)


def test_a_sized_exchange_is_refused_where_it_cannot_run():
    """An exchange sized at run time moves whole pieces once: walked along
    a stream axis, or one that moves nothing, is a lowering error that
    says so (a walk or a stream loop would cut the pieces the counts
    describe)."""
    from hostir import FusionDefinition
    from hostir.lower.record import LoweringError

    def program(stream: bool, moves: bool = True):
        with FusionDefinition() as fd:
            x = fd.define_tensor([2, 2, 6, 8])
            rows = fd.define_tensor([2, 2, 3], dtype=torch.int64)
            rows_in = fd.ops.set(rows)
            y = fd.ops.set(x, rows=(rows, rows_in))
            fd.add_output(y)
        for tv, axis in ((x, 0), (rows, 0), (rows_in, 1 if moves else 0), (y, 1 if moves else 0)):
            tv.set_device_mesh(DeviceMesh(range(2)))
            tv.axis(axis).parallelize(ir.ParallelType.mesh_x)
        if stream:
            y.axis(0).parallelize(ir.ParallelType.stream)
        return fd

    lower(program(stream=False).fusion, rank=0, backend="gloo")
    with pytest.raises(LoweringError, match="an exchange sized at run time .* is not walked"):
        lower(program(stream=True).fusion, rank=0, backend="gloo")
    with pytest.raises(LoweringError, match="a set sized by rows must move a sharded axis"):
        lower(program(stream=False, moves=False).fusion, rank=0, backend="gloo")


@pytest.mark.parametrize("fused", [False, True], ids=["gate_up_apart", "gate_up_fused"])
@pytest.mark.parametrize("exact, overlap", [(True, None), (True, True), (False, None)])
def test_the_layer_on_one_rank_matches_torch(exact, overlap, fused):
    """On one rank every pair stays (the exchanges are plain copies):
    outputs and every gradient as eager torch's, in the exact form (and
    walked) and the padded one (whose weights' gradients sum over the one
    source), with gate and up apart or as one gate_up."""
    torch.manual_seed(11)
    T, H, F, E, k = 5, 8, 12, 4, 2
    x = torch.randn(T, H)
    indices = torch.topk(torch.rand(T, E), k).indices
    inputs = [x, torch.rand(T, k), torch.randn(E, F, H) / 3, torch.randn(E, F, H) / 3, torch.randn(E, H, F) / 3]
    ours = [t.clone().requires_grad_() for t in inputs]
    theirs = [t.clone().requires_grad_() for t in inputs]
    # On a GPU machine a mesh program runs on the communicator's GPU (the
    # CPU inputs copied there): compared on the CPU.
    experts = [torch.cat(ours[2:4], 1), ours[4]] if fused else ours[2:]
    out = MoELayer(DeviceMesh([0]), E, exact=exact, overlap=overlap)(ours[0], indices, ours[1], *experts).cpu()
    xt, wt, gt, ut, dt = theirs
    h = torch.nn.functional.silu(torch.einsum("th,efh->tef", xt, gt)) * torch.einsum("th,efh->tef", xt, ut)
    every = torch.einsum("tef,ehf->teh", h, dt)
    chosen = torch.zeros(T, E).scatter_add(1, indices, wt)
    expected = torch.einsum("te,teh->th", chosen, every)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_planner_sees_the_walked_dispatch():
    """The padded layer's walked dispatch is a device axis the planner
    schedules (`decomposable`), though its input has no mesh until sharding
    propagation places it, and so is its backward's (the combine's
    transpose, an explicit set into the walked layout); the exact form
    walks nothing."""
    from hostir import planner

    fd = layer().fusion(**SHAPE)
    assert planner.decomposable(fd.fusion)
    assert planner.decomposable(derive(fd.fusion, [0, 2, 3, 4, 5]).backward)
    assert not planner.decomposable(layer(overlap=False).fusion(**SHAPE).fusion)
    exact = MoELayer(DeviceMesh(range(2)), 4, exact=True).fusion(**SHAPE)
    assert not planner.decomposable(exact.fusion)
    walked = walked_exact().fusion(**SHAPE)
    assert planner.decomposable(walked.fusion)
    assert planner.decomposable(derive(walked.fusion, [0, 2, 3, 4, 5]).backward)


def test_the_planner_counts_a_walked_grouped_gemm_by_the_rows_it_fills():
    """A step's compute in the planner's model (`_all_to_all_hint`: rows x
    k x n): the padded form's three products over the piece's slots; the
    walked exact form's grouped GEMMs over the share of its bound B that
    a rank's pairs fill on average (T k / (D B)), beside the combine's
    weighting (k choices by H)."""
    from hostir.planner import _all_to_all_hint

    T, k, H, F, D = SHAPE["tokens"], SHAPE["topk"], SHAPE["hidden"], SHAPE["ffn"], 2
    B = math.ceil(1.5 * T * k / D)
    rows, moved, n, itemsize = _all_to_all_hint(walked_exact().fusion(**SHAPE).fusion, None, D)
    assert (rows, moved, itemsize) == (B, 2 * H, 4)
    assert n == int((3 * H * F * T * k / (D * B) + H * k) // (2 * H))
    rows, moved, n, _ = _all_to_all_hint(layer().fusion(**SHAPE).fusion, None, D)
    assert (rows, moved, n) == (2 * T, 2 * H, (3 * H * F + H * k) // (2 * H))


@pytest.mark.parametrize("asked", [None, "sequential"])
def test_last_schedule_says_what_a_call_ran(asked):
    """`fd.last_schedule` is the schedule the latest call's program was
    lowered with: the one asked for, or the planner's, with its figures
    (one rank: no peer to overlap with, so the sequential program, which
    wins the tie)."""
    torch.manual_seed(12)
    T, H, F, E, k = 5, 8, 12, 4, 2
    kwargs = {} if asked is None else {"schedule": asked}
    moe = MoELayer(DeviceMesh([0]), E, **kwargs)
    indices = torch.topk(torch.rand(T, E), k).indices
    args = [torch.randn(T, H), torch.rand(T, k), torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F)]
    moe(args[0], indices, *args[1:])
    (fd,) = moe.fusions.values()
    if asked is None:
        assert fd.last_schedule.decomposition == "sequential", fd.last_schedule
        assert fd.last_schedule.note.startswith("a ring would take"), fd.last_schedule
    else:
        assert fd.last_schedule == Schedule("sequential")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="torch's grouped GEMM kernel: a GPU of compute capability 9.0 or more",
)
@pytest.mark.parametrize("fused", [False, True], ids=["gate_up_apart", "gate_up_fused"])
def test_the_walked_exact_layer_replays_from_a_cuda_graph_on_one_gpu(fused):
    """The exact form walked reads nothing on the host (the routing, the
    gathers and torch's grouped GEMM kernel in bfloat16): on one GPU its
    program is captured in CUDA graphs, and each replay on new tokens and
    routing copied into the captured inputs gives the eager call's output
    and torch's layer."""
    from hostir.runtime import graphs

    torch.manual_seed(13)
    T, H, F, E, k = 64, 64, 32, 4, 2
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    layer = MoELayer(DeviceMesh([0]), E, exact=True, overlap=True, capacity_factor=1.5)
    experts = [torch.randn(E, F, H, device=gpu, dtype=bf16) / 8 for _ in range(2)]
    experts.append(torch.randn(E, H, F, device=gpu, dtype=bf16) / 6)
    gate, up, down = (w.float() for w in experts)
    if fused:
        experts = [torch.cat(experts[:2], 1), experts[2]]

    def call():
        x = torch.randn(T, H, device=gpu, dtype=bf16)
        weights, indices = torch.topk(torch.rand(T, E, device=gpu), k)
        return x, indices, weights.to(bf16)

    captured = list(call())
    captured[2] = captured[2].unsqueeze(-2)
    replay = graphs.capture(layer.fusion(T, k, H, F, bf16, fused=fused), [t.unsqueeze(0) for t in captured + experts])
    for step in range(3):
        x, indices, weights = call()
        for buffer, new in zip(captured, (x, indices, weights.unsqueeze(-2))):
            buffer.copy_(new)
        (out,) = replay()
        out = out.view(T, H)
        torch.testing.assert_close(out, layer(x, indices, weights, *experts), msg=lambda m: f"replay {step}: {m}")
        h = torch.nn.functional.silu(torch.einsum("th,efh->tef", x.float(), gate))
        every = torch.einsum("tef,ehf->teh", h * torch.einsum("th,efh->tef", x.float(), up), down)
        chosen = torch.zeros(T, E, device=gpu).scatter_add(1, indices, weights.float())
        expected = torch.einsum("te,teh->th", chosen, every)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2, msg=lambda m: f"replay {step}: {m}")
