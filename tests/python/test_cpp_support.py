"""The declared table of what the C++ core runs (`hostir.runtime.support`)
is what the flat compiler compiles and what `hostir._C` binds, and both
the lowered program's reasons and the planner's read it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hostir.cpp
from hostir import FusionDefinition, backends, ir, planner
from hostir.kinds import BinaryKind, UnaryKind
from hostir.runtime import flat, flat_communications, support


def test_the_table_names_the_op_classes_the_flat_compiler_compiles():
    assert support.OPS == frozenset(flat._COMPILERS)


def test_the_table_names_the_communication_types_and_backends_the_core_posts():
    assert flat_communications.COMMUNICATION_TYPES == support.COMMUNICATION_TYPES
    assert all(support.runs_backend(b.name) == b.cpp for b in backends.BACKENDS.values())


@pytest.mark.skipif(not hostir.cpp.available(), reason="the C++ executor is not built")
def test_the_table_says_what_the_extension_binds():
    from hostir import _C

    assert set(support.UNARY_KINDS) == set(_C.UNARY_KINDS) and set(support.BINARY_KINDS) == set(_C.BINARY_KINDS)
    assert {b.name for b in backends.BACKENDS.values() if support.runs_backend(b.name)} == set(_C.TRANSPORTS)
    assert _C.OPCODE_COUNT == len(flat.OPCODES)
    assert {k.value for k in UnaryKind} <= set(support.UNARY_KINDS)
    assert {k.value for k in BinaryKind} <= set(support.BINARY_KINDS)


def test_the_grouped_ops_and_a_packed_routes_counts_run_in_the_core():
    """The grouped GEMM, its weights' gradient and a packed route with its
    counts are the core's: no reason, before lowering or after, and a
    program of them is planned for the C++ runner (where it is built)."""
    from hostir import index_ops
    from hostir.lower import lower

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1, 16])
        w = fd.define_tensor(shape=[4, 32, 16])
        c = fd.define_tensor(shape=[-1, 4], dtype=torch.int64)
        idx = fd.define_tensor(shape=[-1, -1, 2], dtype=torch.int64)
        y = fd.ops.grouped_mm(x, w, c)
        fd.add_output(y)
        fd.add_output(index_ops.grouped_outer(y, x, c, 0))
        fd.add_output(fd.ops.route_counts(idx, 4, 8, packed=True))
        fd.add_output(fd.ops.route(idx, 4, 8, packed=True)[1])
    ops = {type(e) for e in fd.fusion.exprs}
    assert ops == {ir.GroupedMmOp, ir.GroupedOuterOp, ir.RouteOp} and ops <= support.OPS
    assert support.fusion_reasons(fd.fusion) == []
    assert flat.unsupported_reasons(lower(fd.fusion).program) == []
    inputs = [torch.randn(2, 10, 16), torch.randn(4, 32, 16), torch.tensor([[2, 0, 3, 1], [0, 4, 4, 2]])]
    inputs.append(torch.randint(0, 4, (2, 5, 2)))
    plan = planner.plan(fd.fusion, inputs, torch.device("cpu"), None, planner.Request())
    assert plan.runner.name == ("cpp" if hostir.cpp.available() else "python"), plan.runner


def test_an_all_to_all_sized_at_run_time_runs_in_the_core(monkeypatch):
    """The exact MoE form's AllToAlls, sized by counts the program computed
    (`set(..., rows=...)`), are the core's (`FEATURES.runtime_rows`): no
    reason before lowering or after, forward and backward; turned off, the
    feature is the reason, named by the AllToAll."""
    from hostir import DeviceMesh
    from hostir.autodiff import derive
    from hostir.lower import lower
    from hostir.moe import MoELayer

    assert support.FEATURES.runtime_rows
    fd = MoELayer(DeviceMesh(range(2)), 4, exact=True).fusion(6, 2, 8, 12, torch.float32)
    backward = derive(fd.fusion, [0, 2, 3, 4, 5]).backward
    for fusion in (fd.fusion, backward):
        assert support.fusion_reasons(fusion) == []
        assert flat.unsupported_reasons(lower(fusion, rank=0, backend="gloo").program) == []
    monkeypatch.setattr(support, "FEATURES", dataclasses.replace(support.FEATURES, runtime_rows=False))
    for fusion in (fd.fusion, backward):
        (reason,) = support.fusion_reasons(fusion)
        assert reason.startswith("it exchanges rows counted at run time: ") and "rows_in" in reason, reason
        lowered = flat.unsupported_reasons(lower(fusion, rank=0, backend="gloo").program)
        assert len(lowered) == 1 and lowered[0].startswith("it exchanges rows counted at run time: "), lowered


def test_a_feature_flipped_on_is_no_longer_a_reason(monkeypatch):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        s = fd.define_scalar(dtype=torch.float64)
        fd.add_output(fd.ops.mul(x, s))
    assert any("floating type" in r for r in support.fusion_reasons(fd.fusion))
    monkeypatch.setattr(support, "FEATURES", dataclasses.replace(support.FEATURES, float_scalars=True))
    assert support.fusion_reasons(fd.fusion) == []


def test_the_fusions_reasons_are_the_lowered_programs_for_its_own_ops():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, 6])
        y = fd.ops.reshape(fd.ops.relu(x), [6, 4])
        fd.add_output(fd.ops.select(fd.ops.slice(y, [0, 0], [3, 4]), 1, 0))
    from hostir.lower import lower

    lowered = flat.unsupported_reasons(lower(fd.fusion).program)
    assert support.fusion_reasons(fd.fusion) == lowered
    assert [r.split(" ")[-1] for r in lowered] == ["ReshapeOp", "SelectOp"]


def test_a_schedule_on_a_transport_the_core_lacks_is_a_reason(monkeypatch):
    for b in backends.BACKENDS.values():
        reasons = support.schedule_reasons(b.name, 1)
        assert (reasons == []) == b.cpp, (b.name, reasons)
    chunked = [] if support.FEATURES.chunk_views else ["it walks chunks of a split axis"]
    assert support.schedule_reasons("NCCL", 2) == chunked
    monkeypatch.setattr(support, "FEATURES", dataclasses.replace(support.FEATURES, chunk_views=False))
    assert support.schedule_reasons("NCCL", 2) == ["it walks chunks of a split axis"]
    assert support.schedule_reasons(None, 1, weight_pieces=4) == ["it walks chunks of a split axis"]


def test_the_plans_runner_is_the_one_that_runs():
    """The planner's runner, said before lowering, is the runner that runs:
    a program with an op the core lacks is planned for Python."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.reshape(fd.ops.relu(x), [-1]))
    x_in = torch.randn(3, 4)
    plan = planner.plan(fd.fusion, [x_in], torch.device("cpu"), None, planner.Request())
    (out,) = fd.execute([x_in])
    torch.testing.assert_close(out, torch.relu(x_in).reshape(-1))
    assert fd.last_runner.name == plan.runner.name
    if hostir.cpp.available():
        assert plan.runner.name == "python"
        assert plan.runner.reasons == ("it has no instruction for ReshapeOp",)


def test_a_program_the_plans_cpp_runner_cannot_run_is_an_error_not_a_move():
    """Nothing chooses again after the plan: a lowered program holding what
    the table says the core cannot run, under a plan for the C++ executor,
    raises and names the reason."""
    from hostir.lower import lower

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, 6])
        fd.add_output(fd.ops.reshape(x, [6, 4]))
    container = lower(fd.fusion).program
    cpp_plan = planner.Plan(None, None, frozenset(), "auto", planner.Runner("cpp"), False, ())
    with pytest.raises(planner.PlanError, match="it has no instruction for ReshapeOp"):
        cpp_plan.runner_for(container)
    predicted = dataclasses.replace(cpp_plan, runner=planner.Runner("python", ("x",)), predicted=True)
    assert predicted.runner_for(container) == planner.Runner("python", ("it has no instruction for ReshapeOp",))
