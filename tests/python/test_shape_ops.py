"""Scalar inputs and the shape ops (permute, reshape, slice, select):
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


CASES = {f.__name__: f for f in (scaled_permute, streamed_permute, reshape_and_slice, streamed_slice, select_by_scalar)}


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
    """permute and a reshape that torch can view return views of the
    input, as torch's ops do; a reshape torch must copy, and a slice, copy."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.permute(x, [1, 0]))
        fd.add_output(fd.ops.reshape(x, [-1]))
        fd.add_output(fd.ops.reshape(fd.ops.permute(x, [1, 0]), [-1]))
        fd.add_output(fd.ops.slice(x, [0, 0], [None, None]))
    x = torch.randn(3, 4)
    outs = fd.execute([x])
    shares = [out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for out in outs]
    expected = [x.permute(1, 0), x.reshape(-1), x.permute(1, 0).reshape(-1), x[0:, 0:]]
    assert shares == [True, True, False, False]
    for out, ref in zip(outs, expected):
        torch.testing.assert_close(out, ref)
    assert outs[0].stride() == (1, 4)


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
    ],
)
def test_bad_arguments_fail_when_defined(op, match):
    with pytest.raises((ValueError, TypeError, IndexError), match=match):
        with FusionDefinition() as fd:
            x = fd.define_tensor([3, 4])
            fd.add_output(op(fd, x))


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
