"""The C++ executor against the Python evaluator on the ops it gained:
every unary kind, the index ops of a mixture-of-experts layer (topk,
route, take, put_add, a backward program's included), and the layouts of
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
        assert any(type(e).__name__ == "PutAddOp" for e in training.backward.fusion.exprs)
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
    """`sums_that_view` takes a sum of a matmul's fresh output, never one of
    an input; the flat program marks it for the C++ executor."""
    from hostir.lower import lower
    from hostir.runtime.flat import compile_program
    from hostir.runtime.fusion_ops import sums_that_view

    container = lower(_product_sum().fusion).program
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
