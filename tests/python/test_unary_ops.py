"""Unary ops: the fusion API, the dump, and evaluation against eager torch,
alone, out of place into a preallocated output, and stream-parallel."""

from __future__ import annotations

import pytest
import torch

from hostir import FusionDefinition, ParallelType
from hostir.lower import lower

from conftest import check_golden

EAGER = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
    "neg": torch.neg,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "abs": torch.abs,
}


def _unary(kind: str, dtype=torch.float32):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        y = getattr(fd.ops, kind)(x)
        fd.add_output(y)
    return fd, y


@pytest.mark.parametrize("kind", sorted(EAGER))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unary_matches_eager(device, kind, dtype):
    fd, _ = _unary(kind, dtype)
    x = torch.randn(5, 7, device=device).to(dtype)
    (out,) = fd.execute([x])
    torch.testing.assert_close(out, EAGER[kind](x))
    prealloc = torch.full_like(x, 7.0)
    (again,) = fd.execute([x], outputs=[prealloc])
    assert again.data_ptr() == prealloc.data_ptr()
    torch.testing.assert_close(prealloc, EAGER[kind](x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32, torch.float64])
def test_cast_matches_eager(device, dtype):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.cast(x, dtype)
        fd.add_output(y)
    x_in = torch.randn(4, 6, device=device) * 10
    (out,) = fd.execute([x_in])
    assert out.dtype == dtype
    torch.testing.assert_close(out, x_in.to(dtype), rtol=0, atol=0)


def test_chain_of_unary_ops_stream_parallel(device):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.neg(fd.ops.silu(x))
        z = fd.ops.cast(y, torch.float64)
        fd.add_output(z)
    for tv in (y, z):
        tv.axis(0).parallelize(ParallelType.stream)
    x_in = torch.randn(6, 5, device=device)
    (out,) = fd.execute([x_in], number_of_streams=2)
    torch.testing.assert_close(out, (-torch.nn.functional.silu(x_in)).double())


def test_unary_dump():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.relu(x)
        z = fd.ops.cast(fd.ops.gelu(y), torch.bfloat16)
        fd.add_output(z)
    check_golden("unary_ops", str(lower(fd.fusion).program))


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda fd, x: fd.ops.exp(fd.define_tensor([-1], torch.int64)), TypeError, "takes a floating-point tensor"),
        (lambda fd, x: fd.ops.cast(x, "float16"), TypeError, "cast needs a torch.dtype"),
        (lambda fd, x: fd.ops.cast(x, torch.complex64), TypeError, "is not supported"),
        (lambda fd, x: fd.ops.relu(3), TypeError, "takes a TensorView"),
    ],
)
def test_unary_definition_errors(build, error, message):
    with pytest.raises(error, match=message):
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=[-1])
            build(fd, x)
            fd.add_output(fd.ops.set(x))
