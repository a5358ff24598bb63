"""Scalar inputs and the shape ops (permute, reshape, slice, select, cat):
golden dumps of the lowered programs, eager comparisons on random data
(inside stream loops too), and the errors of bad arguments."""

from __future__ import annotations

import pytest
import torch

from conftest import check_golden
from hostir import FusionDefinition, LoweringError, ParallelType

STREAM = ParallelType.stream


def scaled_permute(fd):
    x = fd.define_tensor([-1, -1, -1])
    a = fd.define_scalar(float)
    y = fd.ops.mul(fd.ops.permute(x, [2, 0, 1]), a)
    fd.add_output(y)
    return [y], [], (lambda: [torch.randn(4, 3, 2), 1.5]), lambda x, a: [x.permute(2, 0, 1) * a]


def streamed_permute(fd):
    """The stream axis of the mul reaches the permute by propagation."""
    x = fd.define_tensor([-1, -1, -1])
    y = fd.ops.mul(fd.ops.permute(x, [2, 0, 1]), 2.0)
    fd.add_output(y)
    return [y], [(y, 1)], (lambda: [torch.randn(4, 3, 2)]), lambda x: [x.permute(2, 0, 1) * 2.0]


def reshape_and_slice(fd):
    x = fd.define_tensor([-1, -1])
    r = fd.ops.reshape(x, [-1, 6])
    s = fd.ops.slice(r, [1, 0], [None, 6], [2, 3])
    fd.add_output(s)
    return [s], [], (lambda: [torch.randn(4, 9)]), lambda x: [x.reshape(-1, 6)[1::2, 0:6:3]]


def streamed_slice(fd):
    """A slice streamed on the axis it keeps whole."""
    x = fd.define_tensor([-1, -1])
    s = fd.ops.slice(x, [0, 1], [None, 4], None)
    fd.add_output(s)
    return [s], [(s, 0)], (lambda: [torch.randn(5, 6)]), lambda x: [x[:, 1:4]]


def select_by_scalar(fd):
    x = fd.define_tensor([-1, -1, -1])
    k = fd.define_scalar(int)
    s = fd.ops.select(x, k, 1)
    y = fd.ops.add(s, k)
    fd.add_output(y)
    return [y], [(y, 0)], (lambda: [torch.randn(3, 4, 5), -2]), lambda x, k: [x.select(1, k) + k]


def streamed_cat(fd):
    """Three tensors joined along their last axis (pairwise), streamed on
    the axis they share."""
    a, b, c = fd.define_tensor([-1, 3]), fd.define_tensor([-1, 2]), fd.define_tensor([-1, 4])
    y = fd.ops.mul(fd.ops.cat([a, b, c], 1), 2.0)
    fd.add_output(y)
    make = lambda: [torch.randn(5, 3), torch.randn(5, 2), torch.randn(5, 4)]  # noqa: E731
    return [y], [(y, 0)], make, lambda a, b, c: [torch.cat([a, b, c], 1) * 2.0]


CASES = {
    f.__name__: f
    for f in (scaled_permute, streamed_permute, reshape_and_slice, streamed_slice, select_by_scalar, streamed_cat)
}


def _define(build):
    with FusionDefinition() as fd:
        _, streams, make, reference = build(fd)
    for tv, axis in streams:
        tv.axis(axis).parallelize(STREAM)
    return fd, make, reference


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_dump(case):
    fd, _, _ = _define(CASES[case])
    check_golden(f"shape_{case}", fd.host_ir())


@pytest.mark.parametrize("number_of_streams", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case, number_of_streams, device):
    fd, make, reference = _define(CASES[case])
    inputs = [v.to(device) if isinstance(v, torch.Tensor) else v for v in make()]
    outputs = fd.execute(inputs, number_of_streams=number_of_streams)
    expected = reference(*inputs)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref)


def test_outputs_share_memory_with_inputs_where_torch_views():
    """permute, a reshape that torch can view, and a slice return views
    of the input, as torch's ops do; a reshape torch must copy, copies."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.permute(x, [1, 0]))
        fd.add_output(fd.ops.reshape(x, [-1]))
        fd.add_output(fd.ops.reshape(fd.ops.permute(x, [1, 0]), [-1]))
        fd.add_output(fd.ops.slice(x, [0, 0], [None, None]))
        fd.add_output(fd.ops.slice(x, [1, 1], [None, 3], [1, 2]))
    x = torch.randn(3, 4)
    outs = fd.execute([x])
    shares = [out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for out in outs]
    expected = [x.permute(1, 0), x.reshape(-1), x.permute(1, 0).reshape(-1), x[0:, 0:], x[1:, 1:3:2]]
    assert shares == [True, True, False, True, True]
    for out, ref in zip(outs, expected):
        torch.testing.assert_close(out, ref)
    assert outs[0].stride() == (1, 4)


def _halves(fd):
    """A product cut into halves along its last axis (a fused gate_up's
    shape), the halves combined, and one half again on its own."""
    x = fd.define_tensor([-1, 6])
    w = fd.define_tensor([6, 8])
    y = fd.ops.matmul(x, w)
    g = fd.ops.slice(y, [0, 0], [None, 4])
    u = fd.ops.slice(y, [0, 4], [None, None])
    fd.add_output(fd.ops.mul(fd.ops.silu(g), u))
    fd.add_output(fd.ops.exp(fd.ops.slice(x, [1, 0], [None, 6], [2, 3])))


def test_cut_and_joined_tensors_match_eager_forward_and_backward(evaluator):
    """Slices (views), the cat of tiling slices' gradients and an insert
    into zeros of a lone slice's, on each evaluator, against torch."""
    with FusionDefinition() as fd:
        _halves(fd)
    x, w = torch.randn(5, 6, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    outs = fd.execute([x, w])
    y = x @ w
    expected = [torch.nn.functional.silu(y[:, :4]) * y[:, 4:], x[1::2, 0:6:3].exp()]
    for out, ref in zip(outs, expected):
        torch.testing.assert_close(out, ref)
    grads = [torch.randn_like(t) for t in expected]
    theirs = torch.autograd.grad(expected, [x, w], grads)
    ours = torch.autograd.grad(outs, [x, w], grads)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_a_stream_loops_slice_of_its_own_product_is_a_view_of_the_whole_buffer(evaluator):
    """In a stream loop, halves of a product the loop computes are views
    taken once of the product's whole buffer: no buffer of their own, no
    copy per iteration; the results are eager torch's."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([-1, 3, 6]), fd.define_tensor([6, 8])
        y = fd.ops.matmul(x, w)
        g, u = fd.ops.slice(y, [0, 0, 0], [None, None, 4]), fd.ops.slice(y, [0, 0, 4], [None, None, None])
        out = fd.ops.mul(fd.ops.silu(g), u)
        fd.add_output(out)
    out.axis(0).parallelize(STREAM)
    program = fd.host_ir()
    assert "slice(" in program and program.index("slice(") < program.index("FOR StreamIdx")
    assert program.count("ALLOCATE") == 3, program  # the product, the silu, the output
    x, w = torch.randn(4, 3, 6), torch.randn(6, 8)
    y = x @ w
    expected = torch.nn.functional.silu(y[..., :4]) * y[..., 4:]
    torch.testing.assert_close(fd.execute([x, w], number_of_streams=2)[0], expected)


def test_a_cat_writes_into_a_bound_output_inside_a_stream_loop(evaluator):
    """Each iteration's cat goes into its slice of the loop's output."""
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([-1, 2, 3]), fd.define_tensor([-1, 2, 5])
        y = fd.ops.cat([a, b], 2)
        fd.add_output(y)
    y.axis(0).parallelize(STREAM)
    a, b = torch.randn(4, 2, 3), torch.randn(4, 2, 5)
    torch.testing.assert_close(fd.execute([a, b], number_of_streams=2)[0], torch.cat([a, b], 2))


def test_scalar_value_changes_between_runs_without_relowering():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        a = fd.define_scalar(float)
        fd.add_output(fd.ops.sub(a, x))
    x = torch.randn(5)
    for a in (0.5, -3.0, 2):
        torch.testing.assert_close(fd.execute([x, a])[0], a - x)
    assert fd.executor.lowerings == 1


def test_bad_scalar_inputs_name_the_input():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        k = fd.define_scalar(torch.int64)
        fd.add_output(fd.ops.select(x, k, 0))
    with pytest.raises(TypeError, match=r"input 1 \(scalar i\d+\) must be a Python int, got float 1.5"):
        fd.execute([torch.randn(3), 1.5])
    with pytest.raises(TypeError, match="must be a Python int, got Tensor"):
        fd.execute([torch.randn(3), torch.tensor(1)])
    with pytest.raises(Exception, match="index 3 is out of range for axis 0 of T0 \\(size 3\\)"):
        fd.execute([torch.randn(3), 3])
    with pytest.raises(TypeError, match="torch.dtype or float, int or bool"):
        with FusionDefinition() as fd2:
            fd2.define_scalar("double")


@pytest.mark.parametrize(
    "op, match",
    [
        (lambda fd, x: fd.ops.permute(x, [0, 0]), "not a permutation"),
        (lambda fd, x: fd.ops.permute(x, [0, 2]), "axis 2 is out of range"),
        (lambda fd, x: fd.ops.reshape(x, [-1, -1]), "more than one -1"),
        (lambda fd, x: fd.ops.reshape(x, [5, 2]), "has 12 elements"),
        (lambda fd, x: fd.ops.slice(x, [0], [1]), "one start, stop and step per axis"),
        (lambda fd, x: fd.ops.slice(x, [0, 3], [1, 2]), "0 <= start <= stop"),
        (lambda fd, x: fd.ops.slice(x, [0, 0], [1, 5]), r"axis 1 of T0 has size 4; \[0:5\] is out of range"),
        (lambda fd, x: fd.ops.select(x, 3, 0), "index 3 is out of range for axis 0"),
        (lambda fd, x: fd.ops.select(x, 0.5, 0), "the index must be an int"),
        (lambda fd, x: fd.ops.cat([], 0), "a non-empty list of TensorViews"),
        (lambda fd, x: fd.ops.cat([x, fd.ops.permute(x, [1, 0])], 0), "axis 1 of T1 has size 3, of T0 4"),
        (lambda fd, x: fd.ops.cat([x, fd.ops.cast(x, torch.float64)], 0), "does not match T0"),
        (lambda fd, x: fd.ops.cat([x, x], 2), "axis 2 is out of range"),
    ],
)
def test_bad_arguments_fail_when_defined(op, match):
    with pytest.raises((ValueError, TypeError, IndexError), match=match):
        with FusionDefinition() as fd:
            x = fd.define_tensor([3, 4])
            fd.add_output(op(fd, x))


def test_a_slice_of_a_sharded_tensor_must_keep_its_mesh_axis_whole():
    """A slice may take a tensor sharded on an axis of its own if it keeps
    that axis whole (each rank's piece is then cut as the whole tensor);
    one that cuts it is refused when lowered, naming the rule."""
    from hostir import DeviceMesh
    from hostir.lower import lower

    for cut_mesh_axis in (False, True):
        with FusionDefinition() as fd:
            x = fd.define_tensor([2, 4, 6])
            starts, stops = ([1, 0, 0], [2, None, None]) if cut_mesh_axis else ([0, 0, 2], [None, None, 5])
            fd.add_output(fd.ops.slice(x, starts, stops))
        x.set_device_mesh(DeviceMesh([0, 1]))
        x.axis(0).parallelize(ParallelType.mesh_x)
        if cut_mesh_axis:
            with pytest.raises(Exception, match="a slice may take one that is an axis of its own, kept whole"):
                lower(fd.fusion, rank=0, backend="gloo")
        else:
            assert "slice(" in str(lower(fd.fusion, rank=0, backend="gloo").program)


def test_a_slice_past_a_size_known_at_run_time_names_it_on_each_evaluator(evaluator):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(fd.ops.slice(x, [0, 1], [None, 5])))
    with pytest.raises(Exception, match=r"ShapeError: axis 1 .*has size 4; the slice \[1:5\] is out of range"):
        fd.execute([torch.randn(3, 4)])
    torch.testing.assert_close(fd.execute([torch.ones(2, 6)])[0], torch.ones(2, 4).exp())


def test_reshape_to_a_size_the_input_cannot_hold_fails_at_run_time():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.reshape(x, [-1, 5]))
    with pytest.raises(Exception, match=r"cannot reshape T0 of shape \[3, 4\] to \[-1, 5\]"):
        fd.execute([torch.randn(3, 4)])
    torch.testing.assert_close(fd.execute([torch.ones(2, 5)])[0], torch.ones(2, 5))


def test_stream_axis_on_a_reshape_is_an_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.reshape(x, [-1])
        fd.add_output(y)
    y.axis(0).parallelize(STREAM)
    with pytest.raises(LoweringError, match="cannot run chunk by chunk"):
        fd.host_ir()


def test_stream_axis_on_a_cut_slice_axis_is_an_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.slice(x, [1, 0], [3, None])
        fd.add_output(y)
    y.axis(0).parallelize(STREAM)
    with pytest.raises(LoweringError, match="cannot run chunk by chunk"):
        fd.host_ir()
