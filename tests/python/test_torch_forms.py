"""matmul and linear as torch defines them, on one device.

matmul broadcasts batch axes as torch does (aligned from the right, a size-1
axis taking the other operand's size, either operand with fewer axes);
linear also takes nvFuser's weight [*W, N, K], whose leading axes are a
logical split of N (out [..., *W, N]). Each form runs on both evaluators,
whole and with a stream axis, against eager torch on random data; forms that
cannot run are refused with a `hostir.HostIrError` naming the operands.
"""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import DefinitionError, FusionDefinition, ParallelType

STREAM = ParallelType.stream

# (a's declared shape, b's declared shape, a's sizes, b's sizes)
MATMUL_FORMS = {
    "2d_at_batched": ([-1, -1], [-1, -1, -1], (3, 4), (2, 4, 5)),
    "batched_at_2d": ([-1, -1, -1], [-1, -1], (2, 3, 4), (4, 5)),
    "broadcast_both": ([1, -1, -1, -1], [-1, 1, -1, -1], (1, 3, 4, 6), (2, 1, 6, 6)),
    "fewer_batch_axes": ([-1, -1, -1, -1], [-1, -1, -1], (3, 2, 4, 6), (2, 6, 5)),
    "outer_broadcast": ([-1, 1, -1, -1], [-1, -1, -1], (2, 1, 3, 4), (3, 4, 5)),
}


def _matmul(a_shape, b_shape):
    with FusionDefinition() as fd:
        a = fd.define_tensor(a_shape)
        b = fd.define_tensor(b_shape)
        c = fd.ops.matmul(a, b)
        fd.add_output(c)
    return fd, c


@pytest.mark.parametrize("form", sorted(MATMUL_FORMS))
def test_matmul_broadcasts_like_torch(form, evaluator, device):
    a_shape, b_shape, a_size, b_size = MATMUL_FORMS[form]
    fd, c = _matmul(a_shape, b_shape)
    a, b = torch.randn(a_size, device=device), torch.randn(b_size, device=device)
    expected = torch.matmul(a, b)
    assert c.logical_ndim == expected.dim()
    (out,) = fd.execute([a, b])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("form", ["2d_at_batched", "fewer_batch_axes", "outer_broadcast"])
def test_broadcast_matmul_with_a_stream_axis(form, axis, evaluator, device):
    a_shape, b_shape, a_size, b_size = MATMUL_FORMS[form]
    fd, c = _matmul(a_shape, b_shape)
    c.axis(axis).parallelize(STREAM)
    assert fd.host_ir().count("FOR StreamIdx") == 1
    a, b = torch.randn(a_size, device=device), torch.randn(b_size, device=device)
    (out,) = fd.execute([a, b], number_of_streams=2)
    torch.testing.assert_close(out, torch.matmul(a, b))


def test_matmul_batch_sizes_that_differ_are_refused_at_definition():
    with pytest.raises(DefinitionError, match="matmul: batch axis 0 differ: 2 vs 3"):
        with FusionDefinition() as fd:
            fd.ops.matmul(fd.define_tensor([2, -1, -1]), fd.define_tensor([3, -1, -1]))


def test_matmul_batch_sizes_that_differ_are_refused_at_a_call():
    fd, _ = _matmul([-1, -1, -1], [-1, -1, -1])
    with pytest.raises(hostir.HostIrError, match="axis 0 has size 3 but input 0 .* axis 0 has size 2"):
        fd.execute([torch.randn(2, 3, 4), torch.randn(3, 4, 5)])
    fd, _ = _matmul([-1, -1, -1], [-1, -1, -1, -1])
    with pytest.raises(hostir.HostIrError, match="has size"):
        fd.execute([torch.randn(3, 4, 5), torch.randn(2, 2, 5, 6)])


def test_matmul_of_a_vector_is_refused():
    with pytest.raises(DefinitionError, match="must have at least 2 axes"):
        with FusionDefinition() as fd:
            fd.ops.matmul(fd.define_tensor([-1]), fd.define_tensor([-1, -1]))


def linear_nd_reference(x, w, b):
    flat_bias = None if b is None else b.expand(w.shape[:-1]).reshape(-1)
    return torch.nn.functional.linear(x, w.reshape(-1, w.shape[-1]), flat_bias).unflatten(-1, w.shape[:-1])


@pytest.mark.parametrize("bias", ["none", "full", "last_axis"])
def test_linear_with_a_split_weight(bias, evaluator, device):
    d, e = 2, 4
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        w = fd.define_tensor([-1, -1, -1])
        b = None if bias == "none" else fd.define_tensor([-1, -1] if bias == "full" else [-1])
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    x_t, w_t = torch.randn(3, 5, e, device=device), torch.randn(d, e, e, device=device)
    b_t = {"none": None, "full": torch.randn(d, e, device=device), "last_axis": torch.randn(e, device=device)}[bias]
    expected = linear_nd_reference(x_t, w_t, b_t)
    assert expected.shape == (3, 5, d, e) and y.logical_ndim == 4
    (out,) = fd.execute([x_t, w_t] + ([] if b_t is None else [b_t]))
    torch.testing.assert_close(out, expected)


def test_linear_with_a_split_weight_and_a_stream_axis(evaluator):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1, -1, -1])
        b = fd.define_tensor([-1, -1])
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    y.axis(1).parallelize(STREAM)
    x_t, w_t, b_t = torch.randn(6, 4), torch.randn(3, 5, 4), torch.randn(3, 5)
    (out,) = fd.execute([x_t, w_t, b_t], number_of_streams=2)
    torch.testing.assert_close(out, linear_nd_reference(x_t, w_t, b_t))


def test_linear_bias_that_does_not_match_the_weight_is_refused():
    for bias_shape, message in [([3, 5], "axis 0 of weight and bias differ: 2 vs 3"), ([-1, -1, -1], "bias T2 must have")]:
        with pytest.raises(DefinitionError, match=message):
            with FusionDefinition() as fd:
                x = fd.define_tensor([-1, 4])
                w = fd.define_tensor([2, 5, 4])
                fd.ops.linear(x, w, fd.define_tensor(bias_shape))
