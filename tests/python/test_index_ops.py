"""The index ops of a mixture-of-experts layer (`topk`, `route`, `take`,
`put_add`) against eager torch on random data: values, the routing
against a loop that places each (token, choice) pair by hand, gradients
(gradcheck in float64) and the errors of bad definitions."""

from __future__ import annotations

import pytest
import torch

from hostir import FusionDefinition
from hostir.errors import DefinitionError, DefinitionTypeError


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
        with pytest.raises(DefinitionError, match="no row axis"):
            fd.ops.take(x, idx, batch=1, features=1)
        with pytest.raises(DefinitionError, match="batch axis 0 of the rows and the index: sizes 4 and 3"):
            fd.ops.take(x, fd.define_tensor([3, 2], dtype=torch.int64), batch=1, features=0)
        fd.add_output(fd.ops.set(x))
