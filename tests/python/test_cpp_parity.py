"""The C++ executor against the Python evaluator on the ops it gained:
every unary kind, the index ops of a mixture-of-experts layer (topk,
route, packed route and its counts, take, put_add, a backward program's
included), the grouped GEMM and its weights' gradient (grouped_mm,
grouped_outer: torch's kernel's path and the loop's, a shared weight, a
stream loop, a backward program), and the layouts of
sharded, split and partial-sum programs (one rank of a mesh here;
tests/python/multidevice/test_cpp_parity.py runs them on 2 and more
ranks). Each program runs on both evaluators on the same random data,
and the runner says the C++ executor ran it."""

from __future__ import annotations

import pytest
import torch

from hostir import FusionDefinition, ParallelType, cpp
from hostir.kinds import UnaryKind
from hostir.runtime import support

needs_cpp = pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}")
pytestmark = needs_cpp


def _build(kind: str, fd, x):
    if kind == "gelu_tanh":
        return fd.ops.gelu(x, approximate="tanh")
    if kind == "cast":
        return fd.ops.cast(x, torch.float64)
    return getattr(fd.ops, kind)(x)


def _both(fd, inputs, **kwargs):
    """The results of `fd` on the Python evaluator, then on the C++ one
    (which must run it)."""
    python = fd.execute(inputs, evaluator="python", **kwargs)
    assert fd.last_runner.name == "python"
    compiled = fd.execute(inputs, evaluator="cpp", **kwargs)
    assert fd.last_runner.name == "cpp" and fd.last_runner.reasons == (), fd.last_runner
    return python, compiled


def _same(python, compiled):
    assert len(python) == len(compiled)
    for p, c in zip(python, compiled):
        assert p.dtype == c.dtype and p.shape == c.shape
        # The same ATen kernels on the same data: bit for bit.
        torch.testing.assert_close(c, p, rtol=0, atol=0)


@pytest.mark.parametrize("kind", [k.value for k in UnaryKind])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_unary_kind_runs_in_cpp_as_in_python(kind, dtype, device):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        fd.add_output(_build(kind, fd, x))
    x_in = (torch.randn(5, 7, device=device) * 3).to(dtype)
    python, compiled = _both(fd, [x_in])
    _same(python, compiled)
    fn = UnaryKind(kind).torch_fn
    expected = x_in.double() if fn is None else fn(x_in)
    torch.testing.assert_close(compiled[0], expected)


@pytest.mark.parametrize("kind", [k.value for k in UnaryKind])
def test_unary_into_a_preallocated_output(kind, device):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(_build(kind, fd, x))
    x_in = torch.randn(4, 6, device=device)
    dtype = torch.float64 if kind == "cast" else torch.float32
    bufs = [torch.full((4, 6), 7.0, dtype=dtype, device=device) for _ in range(2)]
    python = fd.execute([x_in], outputs=[bufs[0]], evaluator="python")
    compiled = fd.execute([x_in], outputs=[bufs[1]], evaluator="cpp")
    assert fd.last_runner.name == "cpp"
    assert compiled[0].data_ptr() == bufs[1].data_ptr()
    _same(python, compiled)


@pytest.mark.parametrize("kind", ["relu", "neg", "abs"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_unary_kinds(kind, dtype, device):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=dtype)
        fd.add_output(_build(kind, fd, x))
    x_in = torch.randint(-50, 50, (11,), device=device).to(dtype)
    python, compiled = _both(fd, [x_in])
    _same(python, compiled)
    torch.testing.assert_close(compiled[0], UnaryKind(kind).torch_fn(x_in))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float16, torch.bool])
def test_cast_to_each_dtype(dtype, device):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.cast(x, dtype))
    x_in = torch.randn(3, 8, device=device) * 10
    python, compiled = _both(fd, [x_in])
    _same(python, compiled)
    assert compiled[0].dtype == dtype


@pytest.mark.parametrize("number_of_streams", [1, 3])
def test_unary_chain_stream_parallel(number_of_streams, device):
    """Unary ops inside a stream loop write into the selected rows of
    their outputs."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.gelu(fd.ops.silu(x), approximate="tanh")
        z = fd.ops.cast(fd.ops.sigmoid(y), torch.float64)
        fd.add_output(z)
    for tv in (y, z):
        tv.axis(0).parallelize(ParallelType.stream)
    x_in = torch.randn(6, 5, device=device)
    python, compiled = _both(fd, [x_in], number_of_streams=number_of_streams)
    _same(python, compiled)
    expected = torch.sigmoid(torch.nn.functional.gelu(torch.nn.functional.silu(x_in), approximate="tanh")).double()
    torch.testing.assert_close(compiled[0], expected)


def test_the_core_knows_every_unary_kind():
    """A kind declared in hostir.kinds without its ATen call in the C++ core
    would run on the Python evaluator: today every kind has one."""
    assert sorted(support.UNARY_KINDS) == sorted(k.value for k in UnaryKind)


def test_a_unary_kind_the_core_lacks_says_so(monkeypatch):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    monkeypatch.setattr(support, "UNARY_KINDS", tuple(k for k in support.UNARY_KINDS if k != "silu"))
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.relu(fd.ops.silu(x)))
    x_in = torch.randn(3, 4)
    (out,) = fd.execute([x_in])
    torch.testing.assert_close(out, torch.relu(torch.nn.functional.silu(x_in)))
    assert fd.last_runner.name == "python"
    assert [r.split(":")[0] for r in fd.last_runner.reasons] == ["it has no instruction for silu"]


def test_parallel_linears_on_one_rank_run_in_cpp(monkeypatch):
    """`hostir.parallel`'s colwise and rowwise Linears on a one-rank mesh:
    their forward and backward programs (sharded operands, split axes, a
    partial sum completed by an Allreduce, a permute) run on the C++
    executor, strictly, with the Python evaluator's results and torch's."""
    import copy

    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hostir import DeviceMesh, communicator
    from hostir.parallel import parallelize_module

    for name in communicator.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # A CPU mesh runs on gloo: a communicator an earlier test left (NCCL on
    # a machine with GPUs) is shut down first.
    communicator.shutdown()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6))
    model = copy.deepcopy(ref)
    try:
        parallelize_module(model, DeviceMesh([0]).to_torch("cpu"), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(5, 8)
        weights = torch.randn(5, 6)
        results = {}
        for evaluator in ("python", "cpp"):
            monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
            inp = x.clone().requires_grad_(True)
            y = model(inp)
            y = y.full_tensor() if isinstance(y, DTensor) else y
            (y * weights).sum().backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            runners = []
            for name in ("0", "2"):
                for fd in model.get_submodule(name)._hostir_linear.fusions.values():
                    for training in fd.__dict__["_trainings"].values():
                        runners += [training.forward.last_runner, training.backward.last_runner]
            assert len(runners) == 4 and all(r.name == evaluator for r in runners), runners
            results[evaluator] = (y.detach(), inp.grad, grads)
            model.zero_grad()
    finally:
        communicator.shutdown()
    (y_py, dx_py, g_py), (y_cpp, dx_cpp, g_cpp) = results["python"], results["cpp"]
    torch.testing.assert_close(y_cpp, y_py, rtol=0, atol=0)
    torch.testing.assert_close(dx_cpp, dx_py, rtol=0, atol=0)
    for name in g_py:
        torch.testing.assert_close(g_cpp[name], g_py[name], rtol=0, atol=0)
    inp = x.clone().requires_grad_(True)
    expected = ref(inp)
    (expected * weights).sum().backward()
    torch.testing.assert_close(y_cpp, expected.detach())
    torch.testing.assert_close(dx_cpp, inp.grad)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(g_cpp[name], p.grad)


def test_the_core_knows_every_binary_kind():
    """The derivative kinds backward programs use included."""
    from hostir.kinds import BinaryKind

    assert sorted(support.BINARY_KINDS) == sorted(k.value for k in BinaryKind)


@pytest.mark.parametrize("kind", ["relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "abs"])
def test_backward_programs_run_in_cpp_as_in_python(kind, monkeypatch):
    """A backward program's derivative kinds (torch's backward kernels) run
    in C++ with the Python evaluator's results and torch's gradients."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(_build(kind, fd, x))
    x_in = torch.randn(4, 6, dtype=torch.float32)
    x_in[0, :2] = 0.0  # relu's and abs's kink
    grads = {}
    for evaluator in ("python", "cpp"):
        monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
        leaf = x_in.clone().requires_grad_(True)
        (out,) = fd.execute([leaf])
        cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        out.backward(cotangent)
        (training,) = fd.__dict__["_trainings"].values()
        assert training.backward.last_runner.name == evaluator, training.backward.last_runner
        grads[evaluator] = leaf.grad
    torch.testing.assert_close(grads["cpp"], grads["python"], rtol=0, atol=0)
    leaf = x_in.clone().requires_grad_(True)
    expected = UnaryKind(kind).torch_fn(leaf)
    expected.backward(torch.linspace(-1, 1, expected.numel()).reshape(expected.shape))
    torch.testing.assert_close(grads["cpp"], leaf.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_the_tie_mask_runs_in_cpp(dtype, device):
    """`eq`, the 0/1 mask of lhs == rhs in lhs's dtype (a max's or min's
    backward), on data with ties."""
    from hostir import builders

    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        b = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        fd.add_output(builders.binary("eq", a, b))
    a_in = torch.randint(0, 3, (5, 4), device=device).to(dtype)
    b_in = torch.randint(0, 3, (5, 4), device=device).to(dtype)
    python, compiled = _both(fd, [a_in, b_in])
    _same(python, compiled)
    torch.testing.assert_close(compiled[0], (a_in == b_in).to(dtype))


# ---------------------------------------------------------------- index ops
#
# The index ops of a mixture-of-experts layer (topk, route, take, put_add):
# compute.cpp's twins of fusion_ops.py's torch, the same ATen calls.


def _choices(shape, experts):
    """Distinct experts per token, as a router's top-k gives them."""
    *lead, tokens, k = shape
    return torch.topk(torch.rand(*lead, tokens, experts), k).indices


def test_topk_runs_in_cpp_as_in_python(device):
    torch.manual_seed(10)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 16])
        values, indices = fd.ops.topk(x, 4)
        fd.add_output(values)
        fd.add_output(indices)
    data = torch.randn(3, 5, 16, device=device)
    python, compiled = _both(fd, [data])
    _same(python, compiled)
    expected = torch.topk(data, 4)
    torch.testing.assert_close(compiled[0], expected.values)
    torch.testing.assert_close(compiled[1], expected.indices)


@pytest.mark.parametrize("capacity", [7, 3, 1])
@pytest.mark.parametrize("groups", [1, 3])
def test_route_runs_in_cpp_as_in_python(capacity, groups, device):
    """Each pair's slot and each slot's token, a capacity small enough
    dropping pairs, the sources grouped as `groups` ranks hold the
    experts."""
    torch.manual_seed(11)
    experts = 6
    with FusionDefinition() as fd:
        idx = fd.define_tensor([-1, -1, 2], dtype=torch.int64)
        slot, source = fd.ops.route(idx, experts, capacity, groups=groups)
        fd.add_output(slot)
        fd.add_output(source)
    indices = _choices([2, 7, 2], experts).to(device)
    python, compiled = _both(fd, [indices])
    _same(python, compiled)
    assert list(compiled[1].shape) == [2, groups, experts // groups, capacity]
    assert bool((compiled[0] < 0).any()) == (capacity < 7)


@pytest.mark.parametrize("batch, features", [(0, 1), (1, 1), (1, 0), (0, 0), (0, 2), (2, 1)])
def test_take_and_put_add_run_in_cpp_as_in_python(batch, features, device):
    """Rows by index, negative indices among them (zeros in take, dropped
    in put_add), repeated ones added up in put_add."""
    torch.manual_seed(12)
    lead = [3, 2][:batch]
    feats = [5, 2][:features]
    x = torch.randn(*lead, 4, 2, *feats, device=device)
    index = torch.randint(-2, 8, (*lead, 6), device=device)
    index[..., 1] = -1
    index[..., 3] = index[..., 4] = 7
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1] * x.dim())
        ti = fd.define_tensor([-1] * index.dim(), dtype=torch.int64)
        taken = fd.ops.take(tx, ti, batch=batch, features=features)
        fd.add_output(taken)
        fd.add_output(fd.ops.put_add(taken, ti, tx, batch=batch, features=features))
    python, compiled = _both(fd, [x, index])
    # put_add's sums of repeated rows: in index order on the CPU, by
    # atomics on a GPU.
    _same(python[:1], compiled[:1])
    if device == "cpu":
        _same(python[1:], compiled[1:])
    torch.testing.assert_close(compiled[1], python[1])
    flat = x.reshape(*lead, 8, -1)
    rows = flat.gather(batch, index.clamp(min=0).unsqueeze(-1).expand(*index.shape, flat.shape[-1]))
    expected = rows * (index >= 0).unsqueeze(-1)
    torch.testing.assert_close(compiled[0], expected.reshape(*index.shape, *feats))


def test_index_ops_write_into_preallocated_outputs(device):
    torch.manual_seed(13)
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1, 3])
        ti = fd.define_tensor([-1], dtype=torch.int64)
        scores = fd.define_tensor([-1, 5])
        idx = fd.define_tensor([-1, 2], dtype=torch.int64)
        taken = fd.ops.take(tx, ti)
        fd.add_output(taken)
        fd.add_output(fd.ops.put_add(taken, ti, tx))
        fd.add_output(fd.ops.topk(scores, 2)[1])
        fd.add_output(fd.ops.route(idx, 4, 2, groups=2)[1])
    inputs = [
        torch.randn(5, 3, device=device),
        torch.tensor([4, -1, 0, 2, 0, 3, -2], device=device),
        torch.randn(6, 5, device=device),
        _choices([6, 2], 4).to(device),
    ]
    shapes = [((7, 3), torch.float32), ((5, 3), torch.float32), ((6, 2), torch.int64), ((2, 2, 2), torch.int64)]
    results = {}
    for evaluator in ("python", "cpp"):
        bufs = [torch.full(shape, 7, dtype=dtype, device=device) for shape, dtype in shapes]
        results[evaluator] = fd.execute(inputs, outputs=bufs, evaluator=evaluator)
        assert fd.last_runner.name == evaluator
        assert [r.data_ptr() for r in results[evaluator]] == [b.data_ptr() for b in bufs]
    _same(results["python"], results["cpp"])


@pytest.mark.parametrize("number_of_streams", [1, 3])
def test_take_and_topk_in_a_stream_loop_run_in_cpp_as_in_python(number_of_streams, device):
    """A take and a topk walked by a stream loop over tokens: their
    slices at full rank, the rows taken from whole."""
    torch.manual_seed(14)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 5])
        idx = fd.define_tensor([-1, 2], dtype=torch.int64)
        scores = fd.define_tensor([-1, 6])
        taken = fd.ops.take(x, idx)
        top = fd.ops.topk(scores, 2)[1]
        fd.add_output(taken)
        fd.add_output(top)
    for tv in (taken, top):
        tv.axis(0).parallelize(ParallelType.stream)
    inputs = [torch.randn(7, 5, device=device), torch.randint(-1, 7, (9, 2), device=device)]
    inputs.append(torch.randn(9, 6, device=device))
    python, compiled = _both(fd, inputs, number_of_streams=number_of_streams)
    _same(python, compiled)
    program = fd.host_program(inputs=inputs)
    loops = [e for e in program.walk() if type(e).__name__ == "ForLoop"]
    assert loops and all(any(type(b).__name__ in ("TakeOp", "TopKOp") for b in e.body) for e in loops)


@pytest.mark.parametrize("capacity", [2, 7])
def test_backward_of_a_take_of_route_slots_runs_in_cpp_as_in_python(monkeypatch, capacity):
    """A take of a route's slots (a MoE layer's combine): each slot holds
    at most one pair, so its transpose writes the rows (`distinct`, no
    adds). In C++ as in Python, and as torch's, pairs dropped past the
    capacity (2) included."""
    torch.manual_seed(16)
    T, k, E, H = 7, 2, 4, 6
    with FusionDefinition() as fd:
        ty = fd.define_tensor([2, E, capacity, H])
        ti = fd.define_tensor([2, T, k], dtype=torch.int64)
        slot, _ = fd.ops.route(ti, E, capacity)
        fd.add_output(fd.ops.take(ty, slot, batch=1))
    y, indices = torch.randn(2, E, capacity, H), _choices([2, T, k], E)
    grad = torch.randn(2, T, k, H)
    grads = {}
    for evaluator in ("python", "cpp"):
        monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
        leaf = y.clone().requires_grad_(True)
        (taken,) = fd.execute([leaf, indices])
        taken.backward(grad)
        (training,) = fd.__dict__["_trainings"].values()
        assert training.backward.last_runner.name == evaluator, training.backward.last_runner
        (put,) = [e for e in training.backward.fusion.exprs if type(e).__name__ == "PutAddOp"]
        assert put.distinct
        grads[evaluator] = leaf.grad
    torch.testing.assert_close(grads["cpp"], grads["python"], rtol=0, atol=0)
    slots = _route_reference(indices, E, capacity, 1, False)[0]
    expected = torch.zeros(2, E * capacity, H)
    for b in range(2):
        kept = slots[b] >= 0
        expected[b, slots[b][kept]] = grad[b][kept]
    assert bool((slots < 0).any()) == (capacity < T)
    torch.testing.assert_close(grads["cpp"], expected.view_as(y), rtol=0, atol=0)
    # The slots of two batch elements taken from one tensor repeat: added.
    with FusionDefinition() as shared:
        ty = shared.define_tensor([E, capacity, H])
        ti = shared.define_tensor([2, T, k], dtype=torch.int64)
        slot, _ = shared.ops.route(ti, E, capacity)
        shared.add_output(shared.ops.take(ty, slot))
    leaf = y[0].clone().requires_grad_(True)
    (taken,) = shared.execute([leaf, indices])
    taken.backward(grad)
    (training,) = shared.__dict__["_trainings"].values()
    (put,) = [e for e in training.backward.fusion.exprs if type(e).__name__ == "PutAddOp"]
    assert not put.distinct
    torch.testing.assert_close(leaf.grad, expected.sum(0).view_as(leaf))


def test_backward_of_a_take_runs_in_cpp_as_in_python(monkeypatch):
    """The backward program of a fusion with takes (a topk's values
    included) holds put_adds: it runs in C++ with the Python evaluator's
    gradients, and torch's."""
    torch.manual_seed(15)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 3])
        ti = fd.define_tensor([-1, -1], dtype=torch.int64)
        scores = fd.define_tensor([-1, 7])
        fd.add_output(fd.ops.take(x, ti, batch=1))
        fd.add_output(fd.ops.topk(scores, 3)[0])
    x_in, s_in = torch.randn(2, 5, 3), torch.randn(4, 7)
    index = torch.tensor([[0, 4, -1, 0], [3, 3, 1, -1]])
    grads = {}
    for evaluator in ("python", "cpp"):
        monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
        leaves = [x_in.clone().requires_grad_(True), s_in.clone().requires_grad_(True)]
        taken, values = fd.execute([leaves[0], index, leaves[1]])
        (taken * torch.linspace(-1, 1, taken.numel()).reshape(taken.shape)).sum().backward(retain_graph=True)
        values.backward(torch.linspace(-2, 2, values.numel()).reshape(values.shape))
        (training,) = fd.__dict__["_trainings"].values()
        assert training.forward.last_runner.name == evaluator, training.forward.last_runner
        assert training.backward.last_runner.name == evaluator, training.backward.last_runner
        # An index that is not a route's slots may repeat: the put_adds add.
        puts = [e for e in training.backward.fusion.exprs if type(e).__name__ == "PutAddOp"]
        assert puts and not any(e.distinct for e in puts)
        grads[evaluator] = [leaf.grad for leaf in leaves]
    for c, p in zip(grads["cpp"], grads["python"]):
        torch.testing.assert_close(c, p, rtol=0, atol=0)
    leaves = [x_in.clone().requires_grad_(True), s_in.clone().requires_grad_(True)]
    flat = torch.where(index >= 0, index, 0)
    taken = leaves[0].gather(1, flat.unsqueeze(-1).expand(2, 4, 3)) * (index >= 0).unsqueeze(-1)
    values = torch.topk(leaves[1], 3).values
    (taken * torch.linspace(-1, 1, taken.numel()).reshape(taken.shape)).sum().backward()
    values.backward(torch.linspace(-2, 2, values.numel()).reshape(values.shape))
    for c, leaf in zip(grads["cpp"], leaves):
        torch.testing.assert_close(c, leaf.grad)


def _route_reference(indices, experts, capacity, groups, packed):
    """`route`'s slot, source and counts by a loop over each row's pairs in
    (expert, token, choice) order: a pair's place is the pairs placed
    before it in its expert (its group when `packed`)."""
    *lead, tokens, k = indices.shape
    per = experts // groups
    rows = (groups if packed else experts) * capacity
    flat = indices.reshape(-1, tokens, k).tolist()
    slot = torch.full((len(flat), tokens, k), -1, dtype=torch.int64)
    source = torch.full((len(flat), rows), -1, dtype=torch.int64)
    counts = torch.zeros(len(flat), experts, dtype=torch.int64)
    for b, choices in enumerate(flat):
        placed: dict[int, int] = {}
        for e, t, j in sorted((e, t, j) for t, row in enumerate(choices) for j, e in enumerate(row)):
            key = e // per if packed else e
            place = placed[key] = placed.get(key, -1) + 1
            if place < capacity:
                slot[b, t, j] = key * capacity + place
                source[b, key * capacity + place] = t
                counts[b, e] += 1
    shape = [groups, capacity] if packed else [groups, per, capacity]
    return slot.reshape(indices.shape), source.reshape(*lead, *shape), counts.reshape(*lead, groups, per)


@pytest.mark.parametrize("packed, capacity", [(False, 7), (False, 2), (True, 14), (True, 4), (True, 1)])
@pytest.mark.parametrize("groups", [1, 3])
def test_packed_route_and_counts_run_in_cpp_as_in_python(packed, capacity, groups, device):
    """Each pair's slot, each slot's token and each expert's kept pairs,
    per expert or packed per group (a group's pairs from its first row,
    expert after expert), a capacity small enough dropping pairs."""
    torch.manual_seed(16)
    experts = 6
    with FusionDefinition() as fd:
        idx = fd.define_tensor([-1, -1, 2], dtype=torch.int64)
        slot, source = fd.ops.route(idx, experts, capacity, groups=groups, packed=packed)
        fd.add_output(slot)
        fd.add_output(source)
        fd.add_output(fd.ops.route_counts(idx, experts, capacity, groups=groups, packed=packed))
    indices = _choices([2, 7, 2], experts).to(device)
    python, compiled = _both(fd, [indices])
    _same(python, compiled)
    expected = _route_reference(indices.cpu(), experts, capacity, groups, packed)
    for c, e in zip(compiled, expected):
        torch.testing.assert_close(c.cpu(), e, rtol=0, atol=0)
    assert bool((compiled[0] < 0).any()) == (int(compiled[2].sum()) < indices.numel())


def _group_counts(batch, groups, rows):
    """Rows per group for each batch element: group 1 empty, at most
    `rows` in all; with several batch elements the first holds exactly
    `rows`, and the last always fewer (rows past its groups' total)."""
    counts = torch.randint(0, rows // (groups - 1) + 1, (*batch, groups))
    counts[..., 1] = 0
    flat = counts.view(-1, groups)
    if flat.shape[0] > 1:
        flat[0] = 0
        flat[0, 0], flat[0, -1] = rows - rows // 2, rows // 2
    flat[-1, -1] = 0
    assert int(counts.sum(-1).max()) <= rows
    return counts


def _grouped_mm_reference(x, weight, counts):
    """Row by row in float64: each row of x times its group's weight (the
    weight expanded over the rows' leading batch axes), zeros past the
    groups' rows."""
    *batch, rows, _ = x.shape
    ws = weight.double().expand(*batch, *weight.shape[-3:]).reshape(-1, *weight.shape[-3:])
    xs = x.double().reshape(-1, rows, x.shape[-1])
    out = torch.zeros(xs.shape[0], rows, weight.shape[-2], dtype=torch.float64)
    for i, row in enumerate(counts.reshape(xs.shape[0], -1).tolist()):
        r = 0
        for g, c in enumerate(row):
            for _ in range(c):
                out[i, r] = ws[i, g] @ xs[i, r]
                r += 1
    return out.to(x.dtype).reshape(*batch, rows, weight.shape[-2])


def _grouped_outer_reference(x, other, counts, wbatch):
    """Per batch element and group in float64, the rows' outer products
    summed, then summed over the leading batch axes the result lacks."""
    *batch, rows, n = x.shape
    k, groups = other.shape[-1], counts.shape[-1]
    xs, os_ = x.double().reshape(-1, rows, n), other.double().reshape(-1, rows, k)
    full = torch.zeros(xs.shape[0], groups, n, k, dtype=torch.float64)
    for i, row in enumerate(counts.reshape(xs.shape[0], groups).tolist()):
        start = 0
        for g, c in enumerate(row):
            full[i, g] = xs[i, start : start + c].T @ os_[i, start : start + c]
            start += c
    full = full.reshape(*batch, groups, n, k)
    lead = len(batch) - wbatch
    return (full.sum(tuple(range(lead))) if lead else full).to(x.dtype)


def _grouped_kernel(device, dtype, *sizes) -> bool:
    """Whether torch's grouped GEMM kernel runs (`fusion_ops.grouped_mm`'s
    rule): bfloat16 on a CUDA device of compute capability 9.0 or more,
    every row stride a multiple of 16 bytes; elsewhere a matmul per group."""
    if device != "cuda" or dtype is not torch.bfloat16 or torch.cuda.get_device_capability() < (9, 0):
        return False
    return all(n * 2 % 16 == 0 for n in sizes)


def _both_on_path(fd, inputs, kernel: bool):
    """`_both`, each run profiled: both call `aten::_grouped_mm` (the
    kernel's path) or neither does (the loop's)."""
    from torch.profiler import profile

    with profile() as python_prof:
        python = fd.execute(inputs, evaluator="python")
    with profile() as cpp_prof:
        compiled = fd.execute(inputs, evaluator="cpp")
    assert fd.last_runner.name == "cpp" and fd.last_runner.reasons == (), fd.last_runner
    for prof in (python_prof, cpp_prof):
        assert any(e.name == "aten::_grouped_mm" for e in prof.events()) == kernel
    return python, compiled


# (K, N, dtype): bfloat16 with 16-byte rows takes torch's grouped GEMM
# kernel on a GPU of compute capability 9.0 or more; the rest (and every
# case on the CPU) a matmul per group.
GROUPED_MM_CASES = [(16, 32, torch.float32), (5, 6, torch.float32), (16, 8, torch.bfloat16), (4, 8, torch.bfloat16)]


@pytest.mark.parametrize("K, N, dtype", GROUPED_MM_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("batch, wbatch", [([], 0), ([3], 1), ([3, 2], 1), ([3, 2], 0)])
def test_grouped_mm_runs_in_cpp_as_in_python(K, N, dtype, batch, wbatch, device):
    """Rows grouped by counts (an empty group among them, rows past the
    groups' total zeroed) times their groups' weights, on the kernel's path
    and on the loop's (the same in both evaluators); a weight with fewer
    batch axes than the rows shared by the leading ones."""
    torch.manual_seed(17)
    G, R = 4, 10
    wshape = [*batch[len(batch) - wbatch :], G, N, K]
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1] * (len(batch) + 1) + [K], dtype=dtype)
        tw = fd.define_tensor([-1] * (wbatch + 1) + [N, K], dtype=dtype)
        tc = fd.define_tensor([-1] * (len(batch) + 1), dtype=torch.int64)
        fd.add_output(fd.ops.grouped_mm(tx, tw, tc))
    x = torch.randn(*batch, R, K).to(dtype)
    weight = torch.randn(*wshape).to(dtype)
    counts = _group_counts(batch, G, R)
    inputs = [t.to(device) for t in (x, weight, counts)]
    python, compiled = _both_on_path(fd, inputs, _grouped_kernel(device, dtype, K, N))
    _same(python, compiled)
    expected = _grouped_mm_reference(x, weight, counts)
    torch.testing.assert_close(compiled[0].cpu(), expected)
    past = torch.arange(R) >= counts.sum(-1, keepdim=True)
    assert past.any() and bool((compiled[0].cpu()[past] == 0).all())


# (R, N, K, dtype): the kernel takes x^T [N, R] and other [R, K].
GROUPED_OUTER_CASES = [
    (12, 8, 4, torch.float32),
    (12, 8, 5, torch.float32),
    (16, 8, 16, torch.bfloat16),
    (12, 8, 16, torch.bfloat16),
]


@pytest.mark.parametrize("R, N, K, dtype", GROUPED_OUTER_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("batch, wbatch", [([], 0), ([3], 0), ([3], 1), ([3, 2], 0), ([3, 2], 1)])
def test_grouped_outer_runs_in_cpp_as_in_python(R, N, K, dtype, batch, wbatch, device):
    """Per group, the sum of its rows' outer products (zeros for the empty
    group), summed over the leading batch axes the result lacks, in
    float32 for bfloat16; on the kernel's path and on the loop's."""
    from hostir import index_ops

    torch.manual_seed(18)
    G = 4
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1] * (len(batch) + 1) + [N], dtype=dtype)
        to = fd.define_tensor([-1] * (len(batch) + 1) + [K], dtype=dtype)
        tc = fd.define_tensor([-1] * (len(batch) + 1), dtype=torch.int64)
        fd.add_output(index_ops.grouped_outer(tx, to, tc, wbatch))
    x = torch.randn(*batch, R, N).to(dtype)
    other = torch.randn(*batch, R, K).to(dtype)
    counts = _group_counts(batch, G, R)
    inputs = [t.to(device) for t in (x, other, counts)]
    python, compiled = _both_on_path(fd, inputs, _grouped_kernel(device, dtype, K, N, R))
    _same(python, compiled)
    assert list(compiled[0].shape) == batch[len(batch) - wbatch :] + [G, N, K]
    expected = _grouped_outer_reference(x, other, counts, wbatch)
    # bfloat16: on the kernel's path each batch element's products are
    # rounded before the float32 sum (a few of its ulps on the summands).
    tol = {} if dtype is torch.float32 else {"rtol": 1.6e-2, "atol": 6e-2}
    torch.testing.assert_close(compiled[0].cpu(), expected, **tol)
    assert bool((compiled[0][..., 1, :, :] == 0).all())


@pytest.mark.parametrize("number_of_streams", [1, 3])
@pytest.mark.parametrize("K", [16, 5])
def test_grouped_ops_in_a_stream_loop_run_in_cpp_as_in_python(number_of_streams, K, device):
    """A grouped_mm and a grouped_outer walked by a stream loop over their
    batch axis: each batch element's slices at full rank, the weight
    shared by every element read whole."""
    from hostir import index_ops

    torch.manual_seed(19)
    B, G, R, N = 3, 4, 12, 8
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1, -1, K])
        tw = fd.define_tensor([G, N, K])
        tc = fd.define_tensor([-1, G], dtype=torch.int64)
        y = fd.ops.grouped_mm(tx, tw, tc)
        gw = index_ops.grouped_outer(y, tx, tc, 1)
        fd.add_output(y)
        fd.add_output(gw)
    for tv in (y, gw):
        tv.axis(0).parallelize(ParallelType.stream)
    x, weight, counts = torch.randn(B, R, K), torch.randn(G, N, K), _group_counts([B], G, R)
    inputs = [t.to(device) for t in (x, weight, counts)]
    python, compiled = _both(fd, inputs, number_of_streams=number_of_streams)
    _same(python, compiled)
    expected = _grouped_mm_reference(x, weight, counts)
    torch.testing.assert_close(compiled[0].cpu(), expected)
    torch.testing.assert_close(compiled[1].cpu(), _grouped_outer_reference(expected, x, counts, 1))
    program = fd.host_program(inputs=inputs)
    loops = [e for e in program.walk() if type(e).__name__ == "ForLoop"]
    names = {type(b).__name__ for e in loops for b in e.body}
    assert loops and {"GroupedMmOp", "GroupedOuterOp"} <= names


def test_grouped_ops_write_into_preallocated_outputs(device):
    from hostir import index_ops

    torch.manual_seed(20)
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1, -1, 16])
        tw = fd.define_tensor([4, 32, 16])
        tc = fd.define_tensor([-1, 4], dtype=torch.int64)
        y = fd.ops.grouped_mm(tx, tw, tc)
        fd.add_output(y)
        fd.add_output(index_ops.grouped_outer(y, tx, tc, 0))
        idx = fd.define_tensor([-1, 2], dtype=torch.int64)
        fd.add_output(fd.ops.route_counts(idx, 4, 3, groups=2, packed=True))
    inputs = [torch.randn(2, 10, 16), torch.randn(4, 32, 16), _group_counts([2], 4, 10), _choices([6, 2], 4)]
    inputs = [t.to(device) for t in inputs]
    shapes = [((2, 10, 32), torch.float32), ((4, 32, 16), torch.float32), ((2, 2), torch.int64)]
    results = {}
    for evaluator in ("python", "cpp"):
        bufs = [torch.full(shape, 7, dtype=dtype, device=device) for shape, dtype in shapes]
        results[evaluator] = fd.execute(inputs, outputs=bufs, evaluator=evaluator)
        assert fd.last_runner.name == evaluator
        assert [r.data_ptr() for r in results[evaluator]] == [b.data_ptr() for b in bufs]
    _same(results["python"], results["cpp"])


def _grouped_mm_torch(x, weight, counts):
    """grouped_mm by torch's autograd-able ops: per batch element, each
    group's rows times its weight, zeros past the groups' rows."""
    *batch, rows, _ = x.shape
    ws = weight.expand(*batch, *weight.shape[-3:]).reshape(-1, *weight.shape[-3:])
    xs = x.reshape(-1, rows, x.shape[-1])
    outs = []
    for i, row in enumerate(counts.reshape(xs.shape[0], -1).tolist()):
        parts, start = [], 0
        for g, c in enumerate(row):
            parts.append(xs[i, start : start + c] @ ws[i, g].T)
            start += c
        parts.append(xs.new_zeros(rows - start, weight.shape[-2]))
        outs.append(torch.cat(parts))
    return torch.stack(outs).reshape(*batch, rows, weight.shape[-2])


@pytest.mark.parametrize("K", [16, 5])
def test_backward_of_a_grouped_mm_runs_in_cpp_as_in_python(K, monkeypatch):
    """The backward program of a grouped_mm holds a grouped_mm (the rows'
    gradient) and a grouped_outer (the weight's, summed over the batch
    axis the weight lacks): it runs in C++ with the Python evaluator's
    gradients, and torch's."""
    torch.manual_seed(21)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, K])
        w = fd.define_tensor([-1, 32, K])
        c = fd.define_tensor([-1, -1], dtype=torch.int64)
        fd.add_output(fd.ops.grouped_mm(x, w, c))
    x_in, w_in, counts = torch.randn(3, 10, K), torch.randn(4, 32, K), _group_counts([3], 4, 10)
    grad = torch.randn(3, 10, 32)
    grads = {}
    for evaluator in ("python", "cpp"):
        monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
        leaves = [x_in.clone().requires_grad_(True), w_in.clone().requires_grad_(True)]
        (out,) = fd.execute([leaves[0], leaves[1], counts])
        out.backward(grad)
        (training,) = fd.__dict__["_trainings"].values()
        assert training.forward.last_runner.name == evaluator, training.forward.last_runner
        assert training.backward.last_runner.name == evaluator, training.backward.last_runner
        names = {type(e).__name__ for e in training.backward.fusion.exprs}
        assert {"GroupedMmOp", "GroupedOuterOp"} <= names, names
        grads[evaluator] = [leaf.grad for leaf in leaves]
    for cg, pg in zip(grads["cpp"], grads["python"]):
        torch.testing.assert_close(cg, pg, rtol=0, atol=0)
    leaves = [x_in.clone().requires_grad_(True), w_in.clone().requires_grad_(True)]
    _grouped_mm_torch(leaves[0], leaves[1], counts).backward(grad)
    for cg, leaf in zip(grads["cpp"], leaves):
        torch.testing.assert_close(cg, leaf.grad)


# ---------------------------------------------------------------- transports
#
# A parity test per C++ transport (csrc/host_ir/transports/), as the op
# parity tests above: the same program on both evaluators, bit for bit.

H = 8


def _host_weights(layers: int):
    """x @ W_l.T then GELU per layer, every W_l in host memory."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H])
        ws = [fd.define_tensor([H, H], memory="host") for _ in range(layers)]
        y = x
        for w in ws:
            y = fd.ops.gelu(fd.ops.linear(y, w))
        fd.add_output(y)
    return fd


@pytest.mark.parametrize("hoist, posted", [("sequential", False), ("hoist", True)])
def test_host_transfers_run_in_cpp_as_in_python(hoist, posted):
    """transports/host.cpp: transfers on the current stream (sequential),
    and posted on the copy stream (hoisted), each read again after the
    weights are written between calls."""
    from hostir import ir

    fd = _host_weights(3)
    x, ws = torch.randn(5, H), [torch.randn(H, H) for _ in range(3)]
    program = fd.host_program(inputs=[x, *ws], hoist=hoist)
    transfers = [e for e in program.walk() if isinstance(e, ir.Transfer)]
    assert transfers and any(e.posted for e in transfers) is posted
    for _ in range(2):
        python, compiled = _both(fd, [x, *ws], hoist=hoist)
        _same(python, compiled)
        ws[1].mul_(-2.0)
    reference = x
    for w in ws:
        reference = torch.nn.functional.gelu(reference @ w.T)
    torch.testing.assert_close(fd.execute([x, *ws], evaluator="cpp", hoist=hoist)[0], reference)


def test_communications_post_on_the_c10d_transport_as_in_python():
    """transports/c10d.cpp: the multi-device parity tests of the c10d
    transport (tests/python/multidevice/test_cpp_parity.py), every
    communication type and P2P on both evaluators, on two gloo ranks."""
    import pathlib

    from spawn import spawn

    root = pathlib.Path(__file__).resolve().parents[2]
    test = root / "tests/python/multidevice/test_cpp_parity.py"
    args = ["pytest", "-q", "-p", "no:cacheprovider", "--color=no", str(test), "-k", "c10d_transport"]
    results = spawn("-m", 2, args=args, env={"HOSTIR_TIMEOUT": "30"}, timeout=240)
    for r in results:
        assert r.returncode == 0 and not r.timed_out, f"rank {r.rank}:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
        assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


def _product_sum():
    """sum(a @ b) over the batch axis: a product made in the program."""
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1, -1])
        b = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.sum(fd.ops.matmul(a, b), [0]))
    return fd


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("evaluator", ["python", "cpp"])
def test_a_sum_over_extent_one_of_a_product_is_its_view(batch, evaluator, device):
    """A sum over axes of extent 1 of a product the program makes binds
    the product's view (no kernel: a batch-of-one weight gradient); over a
    larger extent it sums. Either way torch's values, and a result that a
    later call does not overwrite."""
    fd = _product_sum()
    a1, b1 = torch.randn(batch, 4, 5, device=device), torch.randn(batch, 5, 6, device=device)
    (first,) = fd.execute([a1, b1], evaluator=evaluator)
    assert fd.last_runner.name == evaluator
    torch.testing.assert_close(first, (a1 @ b1).sum(0))
    assert first._is_view() == (batch == 1)
    kept = first.clone()
    a2, b2 = torch.randn(batch, 4, 5, device=device), torch.randn(batch, 5, 6, device=device)
    (second,) = fd.execute([a2, b2], evaluator=evaluator)
    torch.testing.assert_close(second, (a2 @ b2).sum(0))
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    assert first.data_ptr() != second.data_ptr()


@pytest.mark.parametrize("evaluator", ["python", "cpp"])
def test_a_sum_over_extent_one_of_an_input_copies_it(evaluator, device):
    """An input is the caller's memory: its sum over an axis of extent 1 is
    a new tensor, as torch's is, not a view the caller could change."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, [0]))
    x_in = torch.randn(1, 7, device=device)
    (out,) = fd.execute([x_in], evaluator=evaluator)
    torch.testing.assert_close(out, x_in.sum(0))
    assert out.untyped_storage().data_ptr() != x_in.untyped_storage().data_ptr()


def test_the_sums_that_view_are_of_fresh_products_only():
    """`sums_that_view` takes a sum of a matmul's or linear's fresh output,
    never one of an input; the flat program marks it for the C++ executor
    (a matmul's sum over its batch axes runs in the matmul instead:
    tests/python/test_summed_products.py)."""
    from hostir.lower import lower
    from hostir.runtime.flat import compile_program
    from hostir.runtime.fusion_ops import sums_that_view

    container = lower(_product_sum().fusion).program
    sums = [e for e in container.walk() if type(e).__name__ == "ReductionOp"]
    assert len(sums) == 1 and sums_that_view(container) == {id(sums[0])}

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        w = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(fd.ops.linear(x, w), [0]))
    container = lower(fd.fusion).program
    sums = [e for e in container.walk() if type(e).__name__ == "ReductionOp"]
    assert len(sums) == 1 and sums_that_view(container) == {id(sums[0])}
    marked = [i.fields.get("view_sum") for i in compile_program(container).instrs if i.op == "reduction"]
    assert marked == [True]

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, [0]))
    container = lower(fd.fusion).program
    assert sums_that_view(container) == frozenset()
    marked = [i.fields.get("view_sum") for i in compile_program(container).instrs if i.op == "reduction"]
    assert marked == [None]
