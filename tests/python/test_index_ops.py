"""The index ops of a mixture-of-experts layer (`topk`, `route`, `take`,
`put_add`) and its grouped GEMM (`grouped_mm`, with `grouped_outer` its
weights' gradient) against eager torch on random data: values, the
routing (padded and packed) against a loop that places each (token,
choice) pair by hand, the grouped GEMM against a matmul per group,
gradients (gradcheck in float64) and the errors of bad definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostir import FusionDefinition, ParallelType, index_ops, ir, printer
from hostir.errors import DefinitionError, DefinitionTypeError
from hostir.runtime import fusion_ops


def route_by_hand(indices: torch.Tensor, experts: int, capacity: int):
    """Each pair's slot and each slot's token, one pair at a time in token
    order: the definition `route` computes without a loop."""
    *lead, tokens, k = indices.shape
    flat = indices.reshape(-1, tokens, k)
    slots = torch.full(flat.shape, -1, dtype=torch.int64)
    sources = torch.full((flat.shape[0], experts * capacity), -1, dtype=torch.int64)
    for b in range(flat.shape[0]):
        used = [0] * experts
        for t in range(tokens):
            for j in range(k):
                e = int(flat[b, t, j])
                if used[e] < capacity:
                    slots[b, t, j] = e * capacity + used[e]
                    sources[b, e * capacity + used[e]] = t
                used[e] += 1
    return slots.reshape(indices.shape), sources.reshape(*lead, experts * capacity)


def choices(shape, experts, generator=None):
    """Distinct experts per token, as a router's top-k gives them."""
    *lead, tokens, k = shape
    scores = torch.rand(*lead, tokens, experts, generator=generator)
    return torch.topk(scores, k).indices


def test_topk_matches_torch():
    torch.manual_seed(0)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 16])
        values, indices = fd.ops.topk(x, 4)
        fd.add_output(values)
        fd.add_output(indices)
    data = torch.randn(3, 5, 16)
    v, i = fd.execute([data])
    expected = torch.topk(data, 4)
    torch.testing.assert_close(v, expected.values)
    torch.testing.assert_close(i, expected.indices)
    assert i.dtype is torch.int64


@pytest.mark.parametrize("capacity", [7, 3, 1])
def test_route_places_pairs_in_token_order(capacity):
    torch.manual_seed(1)
    experts, groups = 6, 3
    indices = choices([2, 7, 2], experts)
    with FusionDefinition() as fd:
        idx = fd.define_tensor([-1, -1, 2], dtype=torch.int64)
        slot, source = fd.ops.route(idx, experts, capacity, groups=groups)
        fd.add_output(slot)
        fd.add_output(source)
    slot, source = fd.execute([indices])
    slots, sources = route_by_hand(indices, experts, capacity)
    torch.testing.assert_close(slot, slots, rtol=0, atol=0)
    assert list(source.shape) == [2, groups, experts // groups, capacity]
    torch.testing.assert_close(source.reshape(2, -1), sources, rtol=0, atol=0)
    if capacity < 7:
        assert (slot < 0).any(), "a capacity this small drops some pairs"


def route_packed_by_hand(indices: torch.Tensor, experts: int, capacity: int, groups: int):
    """The packed route, one pair at a time in (expert, token) order: a
    group's pairs fill its `capacity` rows from the first; each expert's
    kept pairs counted."""
    *lead, tokens, k = indices.shape
    flat = indices.reshape(-1, tokens, k)
    per = experts // groups
    slots = torch.full(flat.shape, -1, dtype=torch.int64)
    sources = torch.full((flat.shape[0], groups, capacity), -1, dtype=torch.int64)
    counts = torch.zeros(flat.shape[0], groups, per, dtype=torch.int64)
    for b in range(flat.shape[0]):
        pairs = sorted((int(flat[b, t, j]), t, j) for t in range(tokens) for j in range(k))
        used = [0] * groups
        for e, t, j in pairs:
            g = e // per
            if used[g] < capacity:
                slots[b, t, j] = g * capacity + used[g]
                sources[b, g, used[g]] = t
                counts[b, g, e % per] += 1
            used[g] += 1
    return (
        slots.reshape(indices.shape),
        sources.reshape(*lead, groups, capacity),
        counts.reshape(*lead, groups, per),
    )


@pytest.mark.parametrize("capacity", [14, 5, 1])
def test_packed_route_fills_each_group_expert_after_expert(capacity):
    torch.manual_seed(2)
    experts, groups = 6, 3
    indices = choices([2, 7, 2], experts)
    with FusionDefinition() as fd:
        idx = fd.define_tensor([-1, -1, 2], dtype=torch.int64)
        slot, source = fd.ops.route(idx, experts, capacity, groups=groups, packed=True)
        counts = fd.ops.route_counts(idx, experts, capacity, groups=groups, packed=True)
        for t in (slot, source, counts):
            fd.add_output(t)
    got = fd.execute([indices])
    for ours, theirs in zip(got, route_packed_by_hand(indices, experts, capacity, groups)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    if capacity < 5:
        assert (got[0] < 0).any(), "a capacity this small drops some pairs"


def test_the_route_ops_of_one_choice_sort_it_once():
    """On the Python evaluator, slot, source and counts of the same choices
    share one sort in a run (each result handed out once: a repeated op
    gets a tensor of its own)."""
    evaluator = "python"
    torch.manual_seed(9)
    experts, groups, capacity = 6, 2, 9
    indices = choices([2, 7, 2], experts)
    with FusionDefinition() as fd:
        idx = fd.define_tensor([-1, -1, 2], dtype=torch.int64)
        slot, source = fd.ops.route(idx, experts, capacity, groups=groups, packed=True)
        counts = fd.ops.route_counts(idx, experts, capacity, groups=groups, packed=True)
        again = fd.ops.route_counts(idx, experts, capacity, groups=groups, packed=True)
        for t in (slot, source, counts, again):
            fd.add_output(t)
    fd.execute([indices], evaluator=evaluator)
    with torch.profiler.profile() as prof:
        got = fd.execute([indices], evaluator=evaluator)
    assert fd.last_runner.name == evaluator
    sorts = [e for e in prof.events() if e.name == "aten::argsort"]
    assert len(sorts) == 2, [e.name for e in prof.events()][:40]  # the three ops once, the repeat once more
    for ours, theirs in zip(got, route_packed_by_hand(indices, experts, capacity, groups) + (None,)):
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(got[3], got[2], rtol=0, atol=0)
    assert got[3].data_ptr() != got[2].data_ptr()


@pytest.mark.parametrize("capacity", [7, 2])
def test_route_counts_are_each_experts_kept_pairs(capacity):
    torch.manual_seed(3)
    experts, groups = 6, 2
    indices = choices([3, 7, 2], experts)
    with FusionDefinition() as fd:
        idx = fd.define_tensor([-1, -1, 2], dtype=torch.int64)
        fd.add_output(fd.ops.route_counts(idx, experts, capacity, groups=groups))
    (counts,) = fd.execute([indices])
    slots, _ = route_by_hand(indices, experts, capacity)
    kept = torch.stack([((slots >= 0) & (indices == e)).sum((-2, -1)) for e in range(experts)], -1)
    torch.testing.assert_close(counts, kept.reshape(3, groups, experts // groups), rtol=0, atol=0)


def grouped_by_hand(x, weight, counts):
    """A matmul per (batch element, group); zeros past the groups' rows.
    The weight's batch axes are the rows' last ones."""
    *xb, R, _ = x.shape
    G, N = weight.shape[-3], weight.shape[-2]
    xs, cs = x.reshape(-1, R, x.shape[-1]), counts.reshape(-1, G)
    ws = weight.reshape(-1, G, N, weight.shape[-1])
    rows = []
    for i in range(xs.shape[0]):
        pieces, start = [], 0
        for g in range(G):
            n = int(cs[i, g])
            pieces.append(xs[i, start : start + n] @ ws[i % ws.shape[0], g].T)
            start += n
        pieces.append(torch.zeros(R - start, N, dtype=x.dtype))
        rows.append(torch.cat(pieces))
    return torch.stack(rows).reshape(*xb, R, N)


@pytest.mark.parametrize("K, N", [(5, 6), (16, 32)])
def test_grouped_mm_matches_a_matmul_per_group(K, N):
    """Rows grouped by counts (an empty group, rows past the total), a
    weight shared by the leading batch axis: values and both gradients."""
    torch.manual_seed(6)
    R, G = 9, 4
    counts = torch.tensor([[[2, 0, 3, 1], [1, 1, 1, 1], [0, 0, 0, 0]], [[4, 4, 0, 1], [0, 2, 0, 5], [9, 0, 0, 0]]])
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3, R, K])
        w = fd.define_tensor([3, G, N, K])
        c = fd.define_tensor([2, 3, G], dtype=torch.int64)
        fd.add_output(fd.ops.grouped_mm(x, w, c))
    inputs = [torch.randn(2, 3, R, K), torch.randn(3, G, N, K)]
    ours = [t.clone().requires_grad_() for t in inputs]
    theirs = [t.clone().requires_grad_() for t in inputs]
    (out,) = fd.execute([*ours, counts])
    expected = grouped_by_hand(*theirs, counts)
    torch.testing.assert_close(out, expected)
    assert (out[0, 2] == 0).all() and (out[0, 0, 6:] == 0).all()
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    if K == 5:  # the loop reads the counts on the host: more rows than there are is an error
        with pytest.raises(Exception, match=f"must be >= 0 and total at most the {R} rows"):
            fd.execute([*inputs, counts + 3])


def _grouped_dtype(device) -> torch.dtype:
    """bfloat16 where torch's grouped GEMM kernel runs, else float32 (the
    loop of matmuls)."""
    kernel = str(device).startswith("cuda") and torch.cuda.get_device_capability() >= (9, 0)
    return torch.bfloat16 if kernel else torch.float32


def test_grouped_mm_writes_into_a_given_output(device):
    """`out=`: the result lands in the tensor given (no fresh one), the
    same values as a fresh result, zeros past the rows included."""
    dtype = _grouped_dtype(device)
    x = torch.randn(2, 24, 16, device=device, dtype=dtype)
    w = torch.randn(3, 32, 16, device=device, dtype=dtype) / 4
    counts = torch.tensor([[5, 0, 11], [24, 0, 0]], device=device)
    out = torch.full((2, 24, 32), float("nan"), device=device, dtype=dtype)
    got = fusion_ops.grouped_mm(x, w, counts, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, fusion_ops.grouped_mm(x, w, counts), rtol=0, atol=0)
    assert (out[0, 16:] == 0).all()


@pytest.mark.parametrize("K, N", [(5, 6), (16, 32)])
def test_grouped_mm_in_a_stream_loop_matches_a_matmul_per_group(K, N, device, evaluator):
    """Each stream piece's product written into its piece of the output
    buffer (the walked MoE layer's experts), on each evaluator."""
    dtype = _grouped_dtype(device)
    R, G = 16, 3
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, R, K], dtype=dtype)
        w = fd.define_tensor([G, N, K], dtype=dtype)
        c = fd.define_tensor([3, G], dtype=torch.int64)
        y = fd.ops.grouped_mm(x, w, c)
        fd.add_output(fd.ops.mul(y, 2.0))
    y.axis(0).parallelize(ParallelType.stream)
    counts = torch.tensor([[4, 0, 9], [16, 0, 0], [0, 0, 0]], device=device)
    x_, w_ = torch.randn(3, R, K, device=device, dtype=dtype), torch.randn(G, N, K, device=device, dtype=dtype) / 4
    (out,) = fd.execute([x_, w_, counts], number_of_streams=2)
    expected = grouped_by_hand(x_.float().cpu(), w_.float().cpu(), counts.cpu()) * 2
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.float().cpu(), expected, **tol)
    assert (out[0, 13:] == 0).all() and (out[2] == 0).all()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="torch's grouped GEMM kernel needs a GPU of compute capability 9.0",
)
def test_grouped_mm_on_the_kernel_matches_a_matmul_per_group():
    """bfloat16 on the GPU takes `torch._grouped_mm`'s kernel (no host
    synchronization): values and gradients as a float32 matmul per group,
    zeros past the rows."""
    torch.manual_seed(8)
    R, K, N, G = 64, 32, 48, 4
    counts = torch.tensor([[10, 0, 30, 4], [0, 0, 0, 64]], device="cuda")
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, R, K], dtype=torch.bfloat16)
        w = fd.define_tensor([G, N, K], dtype=torch.bfloat16)
        c = fd.define_tensor([2, G], dtype=torch.int64)
        fd.add_output(fd.ops.grouped_mm(x, w, c))
    inputs = [torch.randn(2, R, K, device="cuda"), torch.randn(G, N, K, device="cuda") / 4]
    ours = [t.bfloat16().requires_grad_() for t in inputs]
    theirs = [t.bfloat16().float().requires_grad_() for t in inputs]
    (out,) = fd.execute([*ours, counts])
    expected = grouped_by_hand(*[t.cpu() for t in theirs], counts.cpu())
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)
    assert (out[0, 44:] == 0).all()
    grad = torch.randn_like(expected)
    out.backward(grad.to("cuda", torch.bfloat16))
    expected.backward(grad.bfloat16().float())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.float().cpu(), b.grad.cpu(), rtol=3e-2, atol=1e-1)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="torch's grouped GEMM kernel needs a GPU of compute capability 9.0",
)
@pytest.mark.parametrize("batch, wbatch", [([1], 0), ([2], 0), ([3], 0), ([2, 2], 1), ([3, 2], 1)])
def test_grouped_outer_on_the_kernel_sums_the_batch_as_float32(batch, wbatch):
    """The weights' gradient on the kernel: each group's x^T other, summed
    over the batch elements sharing a weight (one, two: added once; more:
    in float32), as a float64 product per group; empty groups zero."""
    from hostir.runtime.fusion_ops import grouped_outer

    torch.manual_seed(9)
    R, N, K, G = 64, 32, 48, 4
    x = torch.randn(*batch, R, N, device="cuda").bfloat16()
    other = torch.randn(*batch, R, K, device="cuda").bfloat16()
    counts = torch.randint(0, 16, (*batch, G), device="cuda")
    counts[..., 1] = 0
    out = grouped_outer(x, other, counts, wbatch)
    nb = x[..., 0, 0].numel()
    nw = math.prod(batch[len(batch) - wbatch :]) if wbatch else 1
    expected = torch.zeros(nw, G, N, K, dtype=torch.float64)
    xs, os_, cs = x.reshape(nb, R, N).cpu().double(), other.reshape(nb, R, K).cpu().double(), counts.reshape(nb, G)
    for i in range(nb):
        start = 0
        for g, c in enumerate(cs[i].tolist()):
            expected[i % nw, g] += xs[i, start : start + c].T @ os_[i, start : start + c]
            start += c
    assert out.shape == (*batch[len(batch) - wbatch :], G, N, K) if wbatch else out.shape == (G, N, K)
    torch.testing.assert_close(out.reshape(nw, G, N, K).double().cpu(), expected, rtol=2e-2, atol=5e-2)
    assert (out.reshape(nw, G, N, K)[:, 1] == 0).all()


def test_gradcheck_grouped_mm_and_grouped_outer():
    torch.manual_seed(7)
    f64, i64 = torch.float64, torch.int64
    counts = torch.tensor([[2, 0, 3], [1, 3, 0]])
    gmm = _fusion_of(lambda fd, x, w, c: fd.ops.grouped_mm(x, w, c), [[2, 6, 4], [3, 5, 4], [2, 3]], [f64, f64, i64])
    x = torch.randn(2, 6, 4, dtype=f64, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: gmm.execute([x, w, counts])[0], (x, w))
    # The weights' gradient, and its own backward (a double backward).
    with FusionDefinition() as outer:
        a = outer.define_tensor([2, 6, 5], dtype=f64)
        b = outer.define_tensor([2, 6, 4], dtype=f64)
        c = outer.define_tensor([2, 3], dtype=i64)
        outer.add_output(index_ops.grouped_outer(a, b, c))
    a = torch.randn(2, 6, 5, dtype=f64, requires_grad=True)
    b = torch.randn(2, 6, 4, dtype=f64, requires_grad=True)
    (o,) = outer.execute([a.detach(), b.detach(), counts])
    expected = torch.zeros(3, 5, 4, dtype=f64)
    for i in range(2):
        start = 0
        for g in range(3):
            n = int(counts[i, g])
            expected[g] += a[i, start : start + n].T.detach() @ b[i, start : start + n].detach()
            start += n
    torch.testing.assert_close(o, expected)
    assert torch.autograd.gradcheck(lambda a, b: outer.execute([a, b, counts])[0], (a, b))


def test_dispatch_then_combine_returns_each_kept_token():
    """take(x, source) then take(that, slot) gives each pair its token, or
    zeros for a dropped pair."""
    torch.manual_seed(2)
    experts, capacity, tokens = 4, 3, 9
    indices = choices([tokens, 2], experts)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 5])
        idx = fd.define_tensor([-1, 2], dtype=torch.int64)
        slot, source = fd.ops.route(idx, experts, capacity, groups=2)
        rows = fd.ops.take(x, source)
        back = fd.ops.take(rows, slot)
        fd.add_output(back)
        fd.add_output(slot)
    data = torch.randn(tokens, 5)
    back, slot = fd.execute([data, indices])
    expected = data.unsqueeze(1).expand(tokens, 2, 5) * (slot >= 0).unsqueeze(-1)
    torch.testing.assert_close(back, expected)


@pytest.mark.parametrize("batch, features", [(0, 1), (1, 1), (1, 0), (0, 2)])
def test_take_and_put_add_match_torch(batch, features):
    torch.manual_seed(3)
    lead = [3] * batch
    rows = [4, 2]
    feats = [5, 2][:features]
    x = torch.randn(*lead, *rows, *feats)
    index = torch.randint(-2, 8, (*lead, 6))
    with FusionDefinition() as fd:
        tx = fd.define_tensor(list(x.shape))
        ti = fd.define_tensor(list(index.shape), dtype=torch.int64)
        taken = fd.ops.take(tx, ti, batch=batch, features=features)
        fd.add_output(taken)
        fd.add_output(fd.ops.put_add(taken, ti, tx, batch=batch, features=features))
    taken, put = fd.execute([x, index])
    flat = x.reshape(*lead, 8, -1)
    expected = torch.zeros(*lead, 6, flat.shape[-1])
    expected_put = torch.zeros_like(flat)
    for pos in torch.cartesian_prod(*[torch.arange(n) for n in lead + [6]]).reshape(-1, batch + 1):
        *b, p = pos.tolist()
        r = int(index[tuple(b) + (p,)])
        if r >= 0:
            expected[tuple(b) + (p,)] = flat[tuple(b) + (r,)]
            expected_put[tuple(b) + (r,)] += flat[tuple(b) + (r,)]
    torch.testing.assert_close(taken, expected.reshape(*lead, 6, *feats))
    torch.testing.assert_close(put, expected_put.reshape(x.shape))


def _fusion_of(build, shapes, dtypes):
    with FusionDefinition() as fd:
        ins = [fd.define_tensor(s, dtype=d) for s, d in zip(shapes, dtypes)]
        fd.add_output(build(fd, *ins))
    return fd


def test_gradcheck_take_put_add_and_topk():
    torch.manual_seed(4)
    f64, i64 = torch.float64, torch.int64
    take = _fusion_of(lambda fd, x, i: fd.ops.take(x, i, batch=1), [[2, 5, 3], [2, 4]], [f64, i64])
    put = _fusion_of(
        lambda fd, x, i, like: fd.ops.put_add(x, i, like, batch=1), [[2, 4, 3], [2, 4], [2, 5, 3]], [f64, i64, f64]
    )
    top = _fusion_of(lambda fd, x: fd.ops.topk(x, 3)[0], [[4, 7]], [f64])
    index = torch.tensor([[0, 4, -1, 0], [3, 3, 1, -1]])
    x = torch.randn(2, 5, 3, dtype=f64, requires_grad=True)
    rows = torch.randn(2, 4, 3, dtype=f64, requires_grad=True)
    like = torch.zeros(2, 5, 3, dtype=f64)
    scores = torch.randn(4, 7, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: take.execute([x, index])[0], (x,))
    assert torch.autograd.gradcheck(lambda r: put.execute([r, index, like])[0], (rows,))
    assert torch.autograd.gradcheck(lambda s: top.execute([s])[0], (scores,))


def test_gradients_of_a_routed_layer_match_torch():
    """Router, top-k, dispatch, one product per slot, combine: every
    gradient as eager torch's."""
    torch.manual_seed(5)
    tokens, hidden, experts, k, capacity = 10, 6, 4, 2, 10
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, hidden])
        wr = fd.define_tensor([experts, hidden])
        w = fd.define_tensor([experts, hidden, hidden])
        weights, idx = fd.ops.topk(fd.ops.linear(x, wr), k)
        slot, source = fd.ops.route(idx, experts, capacity)
        rows = fd.ops.take(x, source)  # [1, experts, capacity, hidden]
        y = fd.ops.matmul(rows, w)
        back = fd.ops.take(y, slot)  # [tokens, k, hidden]
        fd.add_output(fd.ops.mul(back, fd.ops.broadcast(weights, [False, False, True])))
    inputs = [torch.randn(tokens, hidden), torch.randn(experts, hidden), torch.randn(experts, hidden, hidden)]
    ours = [t.clone().requires_grad_() for t in inputs]
    theirs = [t.clone().requires_grad_() for t in inputs]
    (out,) = fd.execute(ours)
    xt, wrt, wt = theirs
    top = torch.topk(xt @ wrt.T, k)
    expected = torch.stack([torch.bmm(xt.unsqueeze(1), wt[top.indices[:, j]]).squeeze(1) for j in range(k)], 1)
    expected = expected * top.values.unsqueeze(-1)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("capacity", [3, 10])
def test_a_dispatch_given_each_tokens_slots_has_the_same_gradient(capacity):
    """take(x, source, inverse=slot): the gradient gathers each token's
    slots and sums them (no scatter); it equals put_add's and torch's,
    dropped pairs (capacity 3) included, and the take reads as before."""
    torch.manual_seed(6)
    tokens, hidden, experts, k = 9, 5, 4, 2
    indices = choices([2, tokens, k], experts)

    def layer(inverse: bool):
        with FusionDefinition() as fd:
            x = fd.define_tensor([2, tokens, hidden], torch.float64)
            idx = fd.define_tensor([2, tokens, k], dtype=torch.int64)
            slot, source = fd.ops.route(idx, experts, capacity)
            rows = fd.ops.take(x, source, batch=1, inverse=slot if inverse else None)
            fd.add_output(fd.ops.mul(rows, rows))
        return fd

    with_inverse, plain = layer(True), layer(False)
    assert "inverse = T" in printer.print_fusion(with_inverse.fusion)
    x = torch.randn(2, tokens, hidden, dtype=torch.float64)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    (out,) = with_inverse.execute([ours, indices])
    (expected,) = plain.execute([theirs, indices])
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(ours.grad, theirs.grad)
    # Against torch: each token's gradient is the sum over its kept slots.
    _, source = route_by_hand(indices, experts, capacity)
    rows = torch.stack([x[b][source[b].clamp(min=0)] * (source[b] >= 0).unsqueeze(-1) for b in range(2)])
    by_hand = torch.zeros_like(x)
    for b in range(2):
        kept = source[b] >= 0
        by_hand[b].index_add_(0, source[b][kept], (2 * rows[b] * grad[b].reshape(-1, hidden))[kept])
    torch.testing.assert_close(ours.grad, by_hand)
    assert torch.autograd.gradcheck(lambda t: with_inverse.execute([t, indices])[0], (x.clone().requires_grad_(),))


def test_bad_definitions_name_what_is_wrong():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        idx = fd.define_tensor([4, 2], dtype=torch.int64)
        with pytest.raises(DefinitionError, match="k = 7 is more than the 6"):
            fd.ops.topk(x, 7)
        with pytest.raises(DefinitionTypeError, match="must be int64"):
            fd.ops.take(x, x)
        with pytest.raises(DefinitionError, match="do not divide into 4 groups"):
            fd.ops.route(idx, 6, 2, groups=4)
        with pytest.raises(DefinitionError, match="capacity must be an int >= 1"):
            fd.ops.route(idx, 6, 0)
        with pytest.raises(DefinitionError, match="the inverse T.* must be \\[\\*batch, \\*rows, picks per row\\]"):
            fd.ops.take(x, idx, inverse=fd.define_tensor([4, 2, 1], dtype=torch.int64))
        with pytest.raises(DefinitionError, match="axis 0 of the inverse and of the rows: sizes 3 and 4"):
            fd.ops.take(x, idx, inverse=fd.define_tensor([3, 2], dtype=torch.int64))
        with pytest.raises(DefinitionError, match="no row axis"):
            fd.ops.take(x, idx, batch=1, features=1)
        with pytest.raises(DefinitionError, match="batch axis 0 of the rows and the index: sizes 4 and 3"):
            fd.ops.take(x, fd.define_tensor([3, 2], dtype=torch.int64), batch=1, features=0)
        w = fd.define_tensor([3, 5, 6])
        counts = fd.define_tensor([4, 3], dtype=torch.int64)
        with pytest.raises(DefinitionError, match="what must be 'slot', 'source' or 'counts'"):
            index_ops.route(idx, 6, 2, "rows")
        with pytest.raises(DefinitionTypeError, match="counts: the index T.* must be int64"):
            fd.ops.grouped_mm(fd.define_tensor([2, 4, 6]), w, fd.define_tensor([2, 3]))
        with pytest.raises(DefinitionError, match="the counts' groups and the weight's: sizes 2 and 3"):
            fd.ops.grouped_mm(fd.define_tensor([4, 4, 6]), w, fd.define_tensor([4, 2], dtype=torch.int64))
        with pytest.raises(DefinitionError, match="the rows' K and the weight's K: sizes 5 and 6"):
            fd.ops.grouped_mm(fd.define_tensor([4, 4, 5]), w, counts)
        with pytest.raises(DefinitionTypeError, match="rows must be a pair"):
            fd.ops.set(x, rows=counts)
        fd.add_output(fd.ops.set(x))


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.uint8]),
    rows=st.integers(1, 5),
    cols=st.integers(1, 12),
    start=st.integers(0, 3),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_as_words_fills_and_selects_as_the_elements_do(dtype, rows, cols, start, transposed, seed):
    """`fusion_ops.as_words` (the row passes of `take` and `grouped_mm`)
    views a tensor as 8-byte words only where its rows are whole words,
    sharing its memory; a masked fill or a select through the view writes
    the same bits as one over the elements, and nothing outside the view."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(rows * (cols + 3) + 3, generator=g) * 50).to(dtype)
    view = base[start : start + rows * (cols + 3)].view(rows, cols + 3)[:, :cols]
    if transposed:
        view = view.t()
    words = fusion_ops.as_words(view)
    if words is not view:
        assert words.dtype == torch.int64 and words.data_ptr() == view.data_ptr()
        assert words.shape[-1] * 8 == view.shape[-1] * view.element_size()
    mask = torch.rand(view.shape[0], 1, generator=g) < 0.5
    ours, theirs = base.clone(), base.clone()
    for into, fill in ((ours, lambda t: fusion_ops.as_words(t).masked_fill_(mask, 0)), (theirs, None)):
        v = into[start : start + rows * (cols + 3)].view(rows, cols + 3)[:, :cols]
        v = v.t() if transposed else v
        if fill is None:
            v.masked_fill_(mask, 0)
        else:
            fill(v)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    picked = torch.where(mask, fusion_ops.as_words(view), fusion_ops.as_words(view).new_zeros(()))
    expected = torch.where(mask, view, torch.zeros((), dtype=dtype))
    assert torch.equal(picked.flatten().view(torch.uint8), expected.flatten().view(torch.uint8))


def _tiled_gated(fd, join_parts: bool = True, second_read: bool = False):
    """A SwiGLU expert over a fused weight [G, 2F, K] cut into gate and up
    (`join_parts`; else two cuts that leave a row out), and down."""
    f64, i64 = torch.float64, torch.int64
    x = fd.define_tensor([2, 6, 4], dtype=f64)
    gate_up = fd.define_tensor([3, 10, 4], dtype=f64)
    down = fd.define_tensor([3, 4, 5], dtype=f64)
    c = fd.define_tensor([2, 3], dtype=i64)
    stop = 5 if join_parts else 4
    gate = fd.ops.slice(gate_up, [0, 0, 0], [None, stop, None])
    up = fd.ops.slice(gate_up, [0, 5, 0], [None, None, None])
    g = fd.ops.grouped_mm(x, gate, c)
    u = fd.ops.grouped_mm(x, up, c)
    h = fd.ops.mul(fd.ops.silu(g), u if join_parts else fd.ops.slice(u, [0, 0, 0], [None, None, 4]))
    fd.add_output(fd.ops.grouped_mm(h, down if join_parts else fd.ops.slice(down, [0, 0, 0], [None, None, 4]), c))
    if second_read:
        fd.add_output(fd.ops.exp(g))


def _checked_backward(**kwargs) -> ir.Fusion:
    """`_tiled_gated`'s values and gradients against torch's (gradcheck);
    its backward fusion."""
    from hostir.autodiff import derive

    with FusionDefinition() as fd:
        _tiled_gated(fd, **kwargs)
    counts = torch.tensor([[2, 0, 3], [1, 3, 2]])
    leaves = [torch.randn(2, 6, 4), torch.randn(3, 10, 4) / 2, torch.randn(3, 4, 5) / 2]
    leaves = [t.double().requires_grad_() for t in leaves]
    assert torch.autograd.gradcheck(lambda *t: tuple(fd.execute([*t, counts])), tuple(leaves))
    return derive(fd.fusion, [0, 1, 2]).backward


@pytest.mark.parametrize("second_read", [False, True])
def test_a_fused_weights_products_join_in_the_backward(evaluator, second_read):
    """The backward of two grouped GEMMs by the halves of one weight (a
    fused gate_up) runs one grouped GEMM of the halves' output gradients
    joined by the whole weight (no sum of two), and one grouped outer
    product that is the whole weight's gradient (no cat of two): values
    and gradients as torch's (gradcheck), also where g is read twice."""
    bwd = _checked_backward(second_read=second_read)
    outers = [e for e in bwd.exprs if isinstance(e, ir.GroupedOuterOp)]
    assert sorted(o.out.logical_runtime()[-2].extent.value for o in outers) == [4, 10]
    cats = [e for e in bwd.exprs if isinstance(e, ir.CatOp)]
    assert len(cats) == 1 and cats[0].out.logical_runtime()[-1].extent.value == 10
    mms = [e for e in bwd.exprs if isinstance(e, ir.GroupedMmOp)]
    assert len(mms) == 2  # down's input gradient, and gate_up's whole
    assert not any(isinstance(e, ir.SliceOp) for e in bwd.exprs)


def test_a_weight_cut_with_a_gap_keeps_its_products_apart():
    """Cuts that do not tile the weight (a row left out) keep two grouped
    GEMMs and two outer products; the gradients are still torch's."""
    bwd = _checked_backward(join_parts=False)
    assert sum(isinstance(e, ir.GroupedOuterOp) for e in bwd.exprs) == 3
    assert not any(isinstance(e, ir.CatOp) and e.out.logical_runtime()[-1].extent.value == 10 for e in bwd.exprs)
