"""Each op class declares what it reads, writes and binds, and its effect;
the profiler's grouping and `defined_tvs` read those declarations."""

from __future__ import annotations

import dataclasses

import pytest

from hostir import FusionDefinition, ir
from hostir.runtime import profiling

OPS = [c for c in vars(ir).values() if isinstance(c, type) and issubclass(c, ir.Expr) and c is not ir.Expr]


@pytest.mark.parametrize("op", OPS, ids=lambda c: c.__name__)
def test_declarations_name_real_fields(op):
    fields = {f.name for f in dataclasses.fields(op)}
    assert set(op.INPUTS) <= fields and set(op.OUTPUTS) <= fields
    assert op.BINDS is None or set(op.BINDS) <= fields
    assert op.EFFECT in ir.EFFECTS


def test_every_compute_op_is_profiled_as_compute():
    """The profiler groups ops by their declared effect: a unary op is
    compute (it was grouped with host work when the profiler kept its own
    table)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.sum(fd.ops.relu(fd.ops.add(x, x)), [0]))
    kinds = {type(e).__name__: profiling.op_kind(e) for e in fd.fusion.exprs}
    assert kinds == {"BinaryOp": "compute", "UnaryOp": "compute", "ReductionOp": "compute"}


def test_aliases_and_allocations_bind_what_they_declare():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.add(x, x)
        fd.add_output(y)
    y.axis(0).parallelize(ir.ParallelType.stream)
    from hostir.lower import lower

    program = lower(fd.fusion).program
    found = {type(e).__name__: ir.defined_tvs(e) for e in program.walk()}
    selects = [e for e in program.walk() if isinstance(e, ir.HirAliasSelect)]
    allocations = [e for e in program.walk() if isinstance(e, ir.Allocate)]
    assert selects and allocations, found
    assert all(ir.defined_tvs(e) == [e.out] for e in selects)
    assert all(ir.defined_tvs(e) == [e.buffer] for e in allocations)
