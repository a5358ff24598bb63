"""Op kinds are declared once (hostir/kinds.py), with the facts every part
of the package reads: they compare as their names, an unknown one is a
DefinitionError naming the known ones, and their torch functions,
torch.distributed ops and identities are the right ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hostir import FusionDefinition, builders
from hostir.errors import DefinitionError
from hostir.kinds import BinaryKind, ReductionKind, UnaryKind


def test_kinds_are_their_names():
    for kind in [*UnaryKind, *BinaryKind, *ReductionKind]:
        assert kind == kind.value and hash(kind) == hash(kind.value) and f"{kind}" == kind.value
    assert UnaryKind("relu") is UnaryKind.relu


def test_an_op_made_with_a_name_holds_the_kind():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.sum(fd.ops.relu(fd.ops.add(x, x)), [1])
        fd.add_output(y)
    kinds = [e.kind for e in fd.fusion.exprs if hasattr(e, "kind")]
    assert kinds == [BinaryKind.add, UnaryKind.relu, ReductionKind.sum]
    assert all(type(k) is not str for k in kinds)


def test_unknown_kinds_name_the_known_ones():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1])
        with pytest.raises(DefinitionError, match=r"unknown unary op 'erf'; expected one of \['relu', 'neg'"):
            builders.unary("erf", x)
        with pytest.raises(DefinitionError, match=r"unknown reduction 'prod'; expected one of \['sum', 'max', 'min'\]"):
            builders.reduction("prod", x, [0])
        fd.add_output(fd.ops.neg(x))


@pytest.mark.parametrize("kind", [k for k in UnaryKind if k.torch_fn is not None])
def test_unary_facts_match_torch(kind):
    x = torch.randn(5, 3)
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1, -1])
        fd.add_output(builders.unary(kind.value, t))
    (out,) = fd.execute([x], evaluator="python")
    torch.testing.assert_close(out, kind.torch_fn(x))


@pytest.mark.parametrize("kind", list(ReductionKind))
def test_reduction_facts(kind):
    x = torch.randn(4, 6)
    eager = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[kind.value]
    torch.testing.assert_close(kind.torch_fn(x, [1]), eager(x, [1]))
    assert kind.dist_op == getattr(dist.ReduceOp, kind.value.upper())
    for dtype in (torch.float32, torch.int32):
        values = torch.randint(-5, 5, (7,)).to(dtype)
        # The identity changes nothing it is reduced with.
        both = kind.torch_fn(torch.stack([values, torch.full_like(values, kind.identity(dtype))]), [0], dtype=dtype)
        torch.testing.assert_close(both, values)
    assert kind.ignores_nan == (kind is not ReductionKind.sum)


def test_binary_symbols_are_the_dump():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1])
        fd.add_output(fd.ops.div(fd.ops.sub(x, x), x))
    text = str(fd)
    assert "   - T0" in text and "   / T0" in text, text
