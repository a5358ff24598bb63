"""Unary ops: the fusion API, the dump, and evaluation against eager torch,
alone, out of place into a preallocated output, and stream-parallel; and
every kind `hostir.kinds` declares, forward and backward, on both
evaluators."""

from __future__ import annotations

import pytest
import torch

from hostir import FusionDefinition, ParallelType, builders, cpp
from hostir.frontend import Ops
from hostir.kinds import BinaryKind, UnaryKind
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


def _of_kind(kind: UnaryKind, fd, x):
    """The op of `kind` on `x`, as fd.ops spells it (a variant without a
    method of its own through the builder)."""
    if kind is UnaryKind.cast:
        return fd.ops.cast(x, torch.float32)
    if kind.in_ops:
        return getattr(fd.ops, kind.value)(x)
    return builders.unary(kind.value, x)


@pytest.mark.parametrize("kind", list(UnaryKind), ids=str)
def test_every_unary_kind_declares_its_torch_function_and_gradient(kind):
    """A kind is one declaration: what computes it (the Python evaluator
    would run a kind without a torch function as a cast), its backward, and
    whether fd.ops has a method of its name."""
    assert kind.torch_fn is not None or kind is UnaryKind.cast, f"{kind} declares no torch function"
    assert kind.grad is not None, f"{kind} declares no gradient"
    assert kind.grad.reads in (None, "input", "out")
    made_by = BinaryKind if kind.grad.reads is not None else UnaryKind
    assert kind.grad.kind in [k.value for k in made_by], f"{kind}'s gradient names no {made_by.__name__}"
    assert hasattr(Ops, kind.value) == kind.in_ops


@pytest.mark.parametrize(
    "evaluator",
    [
        "python",
        pytest.param("cpp", marks=pytest.mark.skipif(not cpp.available(), reason="the C++ executor is not built")),
    ],
)
@pytest.mark.parametrize("kind", list(UnaryKind), ids=str)
def test_every_unary_kind_trains_as_torch(kind, evaluator, monkeypatch):
    """The forward and the backward program of each declared kind run on
    the evaluator asked for and give torch's values and gradients: a kind
    without its C++ kernel, its gradient, or a derivative kind its gradient
    needs fails here."""
    monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=torch.float64)
        fd.add_output(_of_kind(kind, fd, x))
    x_in = torch.randn(4, 6, dtype=torch.float64)
    x_in = x_in + 0.1 * x_in.sign()  # away from relu's and abs's kink
    leaf = x_in.clone().requires_grad_()
    (out,) = fd.execute([leaf])
    cotangent = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    out.backward(cotangent)
    (training,) = fd.__dict__["_trainings"].values()
    for program in (training.forward, training.backward):
        assert program.last_runner.name == evaluator, program.last_runner
    eager = x_in.clone().requires_grad_()
    expected = eager.to(torch.float32) if kind is UnaryKind.cast else kind.torch_fn(eager)
    expected.backward(cotangent)
    torch.testing.assert_close(out.detach(), expected.detach())
    torch.testing.assert_close(leaf.grad, eager.grad)
