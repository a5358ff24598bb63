"""Backward programs on one device: `torch.autograd.gradcheck` in float64 of
every transpose rule, gradients against eager torch, accumulation into
`.grad`, the plain path under no_grad, and the clear errors (double
backward, CUDA graphs, preallocated outputs, an op without a rule)."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import FusionDefinition
from hostir.autodiff import BackwardError, NoTransposeRuleError, derive

F64 = torch.float64


def leaf(*shape, positive=False):
    t = torch.randn(*shape, dtype=F64)
    if positive:
        t = t.abs() + 0.5
    return t.requires_grad_()


def check(fd, *inputs, evaluator="python"):
    def run(*xs):
        return tuple(fd.execute(list(xs), evaluator=evaluator))

    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-5)


def unary_fusion(build):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        fd.add_output(build(fd, x))
    return fd


@pytest.mark.parametrize(
    "kind",
    ["relu", "gelu", "gelu_tanh", "silu", "neg", "abs", "exp", "tanh", "sigmoid"],
)
def test_unary_rules(kind):
    def build(fd, x):
        if kind == "gelu_tanh":
            return fd.ops.gelu(x, approximate="tanh")
        return getattr(fd.ops, kind)(x)

    fd = unary_fusion(build)
    x = leaf(3, 5)
    if kind in ("relu", "abs"):
        # Away from the kink, where finite differences are defined.
        x = (x.detach() + 0.2 * x.detach().sign()).requires_grad_()
    check(fd, x)


def test_cast_rule():
    fd = unary_fusion(lambda fd, x: fd.ops.cast(fd.ops.mul(fd.ops.cast(x, torch.float32), 2.0), F64))
    x = leaf(4, 3)
    (y,) = fd.execute([x])
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", [([-1, -1], [-1, -1]), ([-1, -1], [1, -1]), ([-1, 1], [-1, -1])], ids=["same", "rhs_bcast", "lhs_bcast"])
def test_binary_rules(kind, shapes):
    with FusionDefinition() as fd:
        a = fd.define_tensor(shapes[0], F64)
        b = fd.define_tensor(shapes[1], F64)
        fd.add_output(getattr(fd.ops, kind)(a, b))
    sa = [3 if s == -1 else 1 for s in shapes[0]]
    sb = [3 if s == -1 else 1 for s in shapes[1]]
    sa[1] = 4 if shapes[0][1] == -1 else 1
    sb[1] = 4 if shapes[1][1] == -1 else 1
    check(fd, leaf(*sa), leaf(*sb, positive=kind == "div"))


@pytest.mark.parametrize("kind", ["add", "mul", "div", "sub"])
def test_binary_with_a_scalar(kind):
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1], F64)
        s = fd.define_scalar(float)
        fd.add_output(getattr(fd.ops, kind)(a, s))
        fd.add_output(getattr(fd.ops, kind)(3.0, a) if kind != "div" else fd.ops.div(a, 3.0))
    x = leaf(2, 3)

    def run(x):
        return tuple(fd.execute([x, 1.5]))

    assert torch.autograd.gradcheck(run, (x,))


@pytest.mark.parametrize("kind", ["sum", "max", "min"])
@pytest.mark.parametrize("dims", [[1], [0], [0, 2]])
def test_reduction_rules(kind, dims):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], F64)
        fd.add_output(getattr(fd.ops, kind)(x, dims))
    check(fd, leaf(3, 4, 2))


@pytest.mark.parametrize("kind", ["max", "min"])
def test_ties_share_the_gradient_as_torch(kind):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        fd.add_output(getattr(fd.ops, kind)(x, [1]))
    data = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, 5.0, -1.0, 4.0]], dtype=F64)
    x = data.clone().requires_grad_()
    ref = data.clone().requires_grad_()
    g = torch.randn(3, dtype=F64)
    (y,) = fd.execute([x])
    y.backward(g)
    (torch.amax if kind == "max" else torch.amin)(ref, 1).backward(g)
    torch.testing.assert_close(x.grad, ref.grad)


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [([3, 4], [4, 5]), ([2, 3, 4], [4, 5]), ([2, 3, 4], [2, 4, 5]), ([1, 3, 4], [2, 4, 5])],
    ids=["2d", "batched_a", "batched_both", "broadcast_batch"],
)
def test_matmul_rule(a_shape, b_shape):
    with FusionDefinition() as fd:
        a = fd.define_tensor([1 if s == 1 else -1 for s in a_shape], F64)
        b = fd.define_tensor([1 if s == 1 else -1 for s in b_shape], F64)
        fd.add_output(fd.ops.matmul(a, b))
    check(fd, leaf(*a_shape), leaf(*b_shape))


@pytest.mark.parametrize(
    "x_shape,w_shape",
    [([3, 4], [5, 4]), ([2, 3, 4], [2, 5, 4]), ([2, 3, 4], [5, 4])],
    ids=["2d", "batched", "broadcast_weight"],
)
@pytest.mark.parametrize("also_plain", [False, True], ids=["transposed_only", "also_read_plain"])
def test_matmul_by_a_transposed_weight(x_shape, w_shape, also_plain):
    """`x @ w^T`: w's gradient is made in w's own layout (the product's
    operands swapped, no permute after it), so the gradient handed to
    autograd is contiguous; with w also read untransposed, both shares
    reach it. Checked by gradcheck and against eager torch."""
    from hostir import autodiff, ir

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(x_shape), F64)
        w = fd.define_tensor([-1] * len(w_shape), F64)
        wt = fd.ops.permute(w, list(range(len(w_shape) - 2)) + [len(w_shape) - 1, len(w_shape) - 2])
        fd.add_output(fd.ops.matmul(x, wt))
        if also_plain:
            fd.add_output(fd.ops.mul(w, w))
    xs, ws = leaf(*x_shape), leaf(*w_shape)
    check(fd, xs, ws)
    d = autodiff.derive(fd.fusion, [0, 1])
    (gw,) = [g for i, g in zip(d.grad_inputs, d.backward.outputs) if i == 1]
    producer = {e.out: e for e in d.backward.exprs}
    assert not isinstance(producer.get(gw), ir.PermuteOp)
    outs = fd.execute([xs, ws])
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    assert ws.grad.is_contiguous()
    xr, wr = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    refs = [xr @ wr.transpose(-1, -2)] + ([wr * wr] if also_plain else [])
    torch.autograd.backward(refs, grads)
    torch.testing.assert_close(ws.grad, wr.grad)
    torch.testing.assert_close(xs.grad, xr.grad)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [[3], [2, 3], [1, 3]], ids=["2d", "3d", "3d_batch_of_one"])
def test_linear_rule(bias, lead):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * (len(lead) + 1), F64)
        w = fd.define_tensor([-1, -1], F64)
        b = fd.define_tensor([-1], F64) if bias else None
        fd.add_output(fd.ops.linear(x, w, b))
    inputs = [leaf(*lead, 4), leaf(5, 4)] + ([leaf(5)] if bias else [])
    check(fd, *inputs)


def test_shape_op_rules():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 6, 4], F64)
        i = fd.define_scalar(int)
        p = fd.ops.permute(x, [2, 0, 1])
        r = fd.ops.reshape(p, [4, -1, 3])
        s = fd.ops.slice(r, [0, 1, 0], [4, None, 3], [1, 2, 1])
        t = fd.ops.select(x, i, 1)
        fd.add_output(fd.ops.mul(s, s))
        fd.add_output(fd.ops.exp(t))
    x = leaf(3, 6, 4)

    def run(x):
        return tuple(fd.execute([x, 2]))

    assert torch.autograd.gradcheck(run, (x,))


def _printed(fusion) -> str:
    from hostir import printer

    return "\n".join(line for e in fusion.exprs for line in printer._lines(e, ""))


@pytest.mark.parametrize("parts", [2, 3])
def test_slices_that_tile_an_axis_transpose_into_one_cat(parts):
    """The cotangents of slices that cut an axis from end to end join in
    cats (one per part but the first), never a zero-filled insert each
    and their sum; a slice that leaves a gap keeps its insert."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 6], F64)
        w = fd.define_tensor([6, 12], F64)
        y = fd.ops.matmul(x, w)
        cuts = [12 * i // parts for i in range(parts + 1)]
        pieces = [fd.ops.slice(y, [0, a], [None, b if b < 12 else None]) for a, b in zip(cuts, cuts[1:])]
        out = pieces[0]
        for p in pieces[1:]:
            out = fd.ops.mul(fd.ops.tanh(out), p)
        fd.add_output(out)
        fd.add_output(fd.ops.exp(fd.ops.slice(x, [0, 1], [None, 3])))
    check(fd, leaf(5, 6), leaf(6, 12))
    backward = _printed(derive(fd.fusion, [0, 1]).backward)
    assert backward.count("cat(") == parts - 1, backward
    assert backward.count("insert(") == 1, backward


def test_a_tiled_slice_without_a_gradient_leaves_its_parts_inserted():
    """Where one part's output has no cotangent, the others are inserted
    into zeros (no cat has the missing part)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4], F64)
        a = fd.ops.slice(x, [0, 0], [None, 2])
        fd.ops.slice(x, [0, 2], [None, None])
        fd.add_output(fd.ops.exp(a))
    check(fd, leaf(3, 4))
    backward = _printed(derive(fd.fusion, [0]).backward)
    assert "cat(" not in backward and backward.count("insert(") == 1, backward


def test_a_slice_of_an_input_is_sliced_again_in_the_backward_not_saved():
    """A fused weight cut into gate and up: the backward reads the input
    and cuts it again (views), so the training forward outputs no copy of
    either part; a slice of a value made in the forward is still saved."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 6], F64)
        gate_up = fd.define_tensor([8, 6], F64)
        gate = fd.ops.slice(gate_up, [0, 0], [4, None])
        up = fd.ops.slice(gate_up, [4, 0], [None, None])
        h = fd.ops.mul(
            fd.ops.silu(fd.ops.matmul(x, fd.ops.permute(gate, [1, 0]))),
            fd.ops.matmul(x, fd.ops.permute(up, [1, 0])),
        )
        y = fd.ops.exp(h)
        fd.add_output(fd.ops.mul(fd.ops.slice(y, [0, 1], [None, 3]), 2.0))
    check(fd, leaf(5, 6), leaf(8, 6))
    d = derive(fd.fusion, [0, 1])
    assert ("input", 1) in d.saved
    assert len(d.forward.outputs) == 1 + sum(kind == "output" for kind, _ in d.saved)
    assert gate not in d.forward.outputs and up not in d.forward.outputs
    backward = _printed(d.backward)
    assert backward.count("slice(") == 2 and backward.count("cat(") == 1, backward


@pytest.mark.parametrize("tiled", [True, False], ids=["halves", "with_a_gap"])
def test_a_fused_weights_batched_products_join_in_the_backward(tiled, evaluator):
    """Batched matmuls by the halves of one weight (the padded MoE layer's
    x @ gate^T and x @ up^T, gate_up [E, 2F, H] cut in two): the backward
    joins the halves' output gradients and runs one matmul by the whole
    weight (no sum of two) and one summed matmul that is the whole
    weight's gradient (no cat of two); cuts that leave a row out keep
    them apart. Values and gradients as torch's either way."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3, 5, 4], F64)  # [source, expert, slot, H]
        gate_up = fd.define_tensor([3, 10, 4], F64)
        stop = 5 if tiled else 4
        gate = fd.ops.slice(gate_up, [0, 0, 0], [None, stop, None])
        up = fd.ops.slice(gate_up, [0, 5, 0], [None, None, None])
        g = fd.ops.matmul(x, fd.ops.permute(gate, [0, 2, 1]))
        u = fd.ops.matmul(x, fd.ops.permute(up, [0, 2, 1]))
        if not tiled:
            u = fd.ops.slice(u, [0, 0, 0, 0], [None, None, None, 4])
        fd.add_output(fd.ops.mul(fd.ops.silu(g), u))
    check(fd, leaf(2, 3, 5, 4), leaf(3, 10, 4), evaluator=evaluator)
    backward = _printed(derive(fd.fusion, [0, 1]).backward)
    if tiled:
        assert backward.count("cat(") == 1 and backward.count("matmul(") == 2, backward
        assert " + " not in backward and "slice(" not in backward, backward
    else:
        assert backward.count("matmul(") == 4, backward


def test_cat_rule():
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, 2, 3], F64)
        b = fd.define_tensor([-1, 4, 3], F64)
        fd.add_output(fd.ops.exp(fd.ops.cat([a, b, a], 1)))
    check(fd, leaf(2, 2, 3), leaf(2, 4, 3))


def test_set_rule():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        fd.add_output(fd.ops.mul(fd.ops.set(x), x))
    check(fd, leaf(3, 3))


def test_mlp_block_matches_eager_and_accumulates_grad():
    torch.manual_seed(0)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8], torch.float32)
        w1 = fd.define_tensor([16, 8], torch.float32)
        b1 = fd.define_tensor([16], torch.float32)
        w2 = fd.define_tensor([8, 16], torch.float32)
        fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1)), w2))
    params = [torch.randn(5, 8), torch.randn(16, 8), torch.randn(16), torch.randn(8, 16)]
    ours = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    g = torch.randn(5, 8)
    for _ in range(2):
        (y,) = fd.execute(ours)
        assert y.grad_fn is not None
        y.backward(g)
        expected = torch.nn.functional.linear(
            torch.nn.functional.gelu(torch.nn.functional.linear(ref[0], ref[1], ref[2])), ref[3]
        )
        expected.backward(g)
        torch.testing.assert_close(y, expected)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)


def test_only_some_inputs_require_grad():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        w = fd.define_tensor([-1, -1], F64)
        fd.add_output(fd.ops.linear(x, w))
    x, w = leaf(3, 4), torch.randn(5, 4, dtype=F64)
    (y,) = fd.execute([x, w])
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, 4))
    assert w.grad is None


def test_no_grad_runs_the_plain_program():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        fd.add_output(fd.ops.relu(x))
    x = leaf(3, 4)
    with torch.no_grad():
        (y,) = fd.execute([x])
    assert y.grad_fn is None and not y.requires_grad
    assert "_trainings" not in fd.__dict__
    (y,) = fd.execute([x.detach()])
    assert y.grad_fn is None and "_trainings" not in fd.__dict__
    (y,) = fd.execute([x])
    assert y.grad_fn is not None and len(fd.__dict__["_trainings"]) == 1


def test_double_backward_is_a_clear_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], F64)
        fd.add_output(fd.ops.tanh(x))
    x = leaf(4)
    (y,) = fd.execute([x])
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=False)
    (y,) = fd.execute([x])
    with pytest.raises(BackwardError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    assert isinstance(BackwardError("x"), hostir.HostIrError)


def test_cuda_graph_and_preallocated_outputs_say_they_do_not_cover_the_backward():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], F64)
        fd.add_output(fd.ops.tanh(x))
    x = leaf(4)
    with pytest.raises(hostir.HostIrError, match="cuda_graph=True does not cover the backward"):
        fd.execute([x], cuda_graph=True)
    with pytest.raises(hostir.HostIrError, match="preallocated outputs and autograd"):
        fd.execute([x], [torch.empty(4, dtype=F64)])


def test_an_op_without_a_rule_names_its_line():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        fd.add_output(fd.ops.reshape(x, [-1]))
    with pytest.raises(NoTransposeRuleError, match=r"(?s)2 symbolic sizes.*reshape\( T0"):
        fd.execute([leaf(2, 3)])


def test_backward_program_is_dumped_with_its_label(capfd, monkeypatch):
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        fd.add_output(fd.ops.sigmoid(x))
    (y,) = fd.execute([leaf(2, 3)])
    y.sum().backward()
    out = capfd.readouterr().out
    assert "Host program (training forward):" in out
    assert "Host program (backward):" in out
    assert "sigmoid_grad(" in out


def test_cpp_evaluator_runs_a_backward_of_its_ops():
    from hostir import cpp

    if not cpp.available():
        pytest.skip(f"C++ executor not built: {cpp.reason()}")
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1], F64)
        b = fd.define_tensor([-1, -1], F64)
        fd.add_output(fd.ops.matmul(fd.ops.add(a, b), b))
    check(fd, leaf(3, 3), leaf(3, 3), evaluator="auto")


# ------------------------------------------------------------ golden backward programs


def _backward_program(fd, sched):
    from hostir import autodiff
    from hostir.lower import lower
    from hostir.lower.schedule import Schedule, parse

    d = autodiff.derive(fd.fusion, list(range(len(fd.fusion.inputs))))
    return lower(d.backward, rank=0, backend="NCCL", schedule=parse(sched) if sched else Schedule())


def test_golden_backward_of_allgather_matmul():
    """The backward of AG+matmul: the weight gradient gathers the saved
    shard (transposed) again in a ring, and each step multiplies the shard
    it received while the next one moves; the input gradient is this rank's
    rows of dy @ w^T, without communication."""
    from conftest import check_golden
    from hostir import overlap

    program = _backward_program(overlap.allgather_matmul(2), None)
    text = str(program.program)
    ring = text.split("(ring,")[1].split("Deallocate")[0]
    assert "P2PCommunication" in ring and "matmul(" in ring
    check_golden("backward_allgather_matmul", program)


def test_golden_backward_of_matmul_reduce_scatter():
    """The backward of matmul+RS: one ring gathers dy chunk by chunk into the
    gradient of the partial products, which both gradients multiply."""
    from conftest import check_golden
    from hostir import overlap

    program = _backward_program(overlap.matmul_reduce_scatter(2), None)
    assert "(ring," in str(program.program)
    check_golden("backward_matmul_reduce_scatter", program)


# ------------------------------------------------------------ what the forward saves


def _megatron(D):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "megatron_mlp.py"
    spec = importlib.util.spec_from_file_location("megatron_mlp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_training_dry_run_reports_peaks_and_saved_bytes():
    example = _megatron(2)
    fd, _ = example.define(2)
    H, rows = example.HIDDEN, 8
    shapes = [[rows, H], [2 * H, H], [2 * H], [H, 2 * H], [H]]
    report = fd.dry_run(shapes, backward=True)
    assert len(report.ranks) == 2
    r = report[0]
    # The backward reads the gelu's input and output, each [2 * rows, 2 * H]
    # on this rank (the whole sequence, its half of the hidden units); the
    # sequence-sharded x is not saved gathered: the backward gathers it again.
    assert sorted(shape for _, shape, _ in r.saved) == [[2 * rows, 2 * H], [2 * rows, 2 * H]]
    assert r.saved_bytes == 2 * (2 * rows * 2 * H * 4)
    assert r.forward_peak_bytes > 0 and r.backward_peak_bytes > 0
    kinds = [t.kind for t in report.backward[0].communications]
    # Two Allgathers: of the output's gradient (sequence-sharded, for both
    # products of the row-parallel linear) and of x again (for w1's
    # gradient); a ReduceScatter of x's gradient.
    assert sorted(kinds) == ["Allgather", "Allgather", "ReduceScatter"], kinds
    kept_report = fd.dry_run(shapes, backward=True, keep_gathered=True)
    assert sorted(t.kind for t in kept_report.backward[0].communications) == ["Allgather", "ReduceScatter"]
    kept = kept_report[0]
    assert [2 * rows, H] in [shape for _, shape, _ in kept.saved]
    assert kept.saved_bytes == r.saved_bytes + 2 * rows * H * 4
    assert "saved between them" in str(report)


def test_training_dry_run_on_one_device():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        w = fd.define_tensor([-1, -1], F64)
        fd.add_output(fd.ops.sum(fd.ops.tanh(fd.ops.matmul(x, w)), [1]))
    report = fd.dry_run([[4, 3], [3, 5]], backward=True)
    (r,) = report.ranks
    # tanh's output [4, 5] float64 is what the backward reads beyond the inputs.
    assert [(shape, dtype) for _, shape, dtype in r.saved] == [([4, 5], "float64")]
    assert r.saved_bytes == 4 * 5 * 8
    assert r.saved_input_bytes == (4 * 3 + 3 * 5) * 8


def test_broadcast_in_dim_and_expand_rules():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 1], F64)
        b = fd.ops.broadcast_in_dim(x, [2, 3, 4], [1, 2])
        e = fd.ops.expand(x, [-1, 4])
        fd.add_output(fd.ops.mul(b, b))
        fd.add_output(fd.ops.tanh(e))
    check(fd, leaf(3, 1))
