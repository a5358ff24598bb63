"""The host IR's IfThenElse in hand-built containers: predicates on loop
indices (comparisons, integers true when non-zero) and on program inputs
(bool and integer scalars), printed in the dump, run by the Python
evaluator and by the C++ executor (integer and bool scalar inputs are integer slots there; a float scalar
input keeps a program on the Python evaluator, which says why), verified (a branch's definitions stay inside it) and race-checked.
"""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import FusionDefinition, check_races, ir
from hostir.runtime import flat
from hostir.container import HostIrContainer, VerifyError


def _vector(c: HostIrContainer, extent: ir.Scalar) -> ir.TensorView:
    return ir.TensorView(c, [ir.IterDomain(c, extent)], torch.float32, ir.MemoryType.global_)


def _loop_with_branches(predicate_of) -> tuple[HostIrContainer, ir.TensorView]:
    """out[i] = x[i] * 2 where predicate_of(i) holds, else x[i] + 100."""
    c = HostIrContainer()
    n = ir.Scalar.symbolic(c)
    x, out = _vector(c, n), _vector(c, n)
    c.add_input(x)
    c.push_back(ir.Allocate(out))
    i = ir.Scalar(label="i")
    x_i, out_i = ir.TensorView(c, [], torch.float32), ir.TensorView(c, [], torch.float32)
    body = [
        ir.HirAliasSelect(x_i, x, x.domain[0], i),
        ir.HirAliasSelect(out_i, out, out.domain[0], i),
        ir.IfThenElse(
            predicate_of(i),
            [ir.BinaryOp(out_i, "mul", x_i, ir.Scalar.constant(2.0))],
            [ir.BinaryOp(out_i, "add", x_i, ir.Scalar.constant(100.0))],
        ),
    ]
    c.push_back(ir.ForLoop(i, ir.Scalar.constant(0), n, body))
    c.add_output(out)
    c.verify()
    return c, x


PREDICATES = {
    "equal": (lambda i: ir.compare("==", i, 2), lambda k: k == 2),
    "less": (lambda i: ir.compare("<", i, 3), lambda k: k < 3),
    "integer_mod": (lambda i: i % 2, lambda k: k % 2 != 0),
    "and": (lambda i: ir.compare("&&", ir.compare(">=", i, 1), ir.compare("!=", i, 4)), lambda k: k >= 1 and k != 4),
}


@pytest.mark.parametrize("case", sorted(PREDICATES))
def test_condition_on_the_loop_index(case, evaluator_class):
    build, holds = PREDICATES[case]
    c, x = _loop_with_branches(build)
    t = torch.randn(6)
    (out,) = evaluator_class(c).run({x: t})
    expected = torch.stack([t[k] * 2 if holds(k) else t[k] + 100 for k in range(6)])
    torch.testing.assert_close(out, expected)
    assert check_races(c) == []


def test_the_dump_prints_both_branches():
    c, _ = _loop_with_branches(lambda i: ir.compare("==", i, 2))
    text = str(c)
    assert (
        "    IF ( i == 2 ):\n"
        "      T4_l_float[]\n"
        "         = T2_l_float[]\n"
        "         * 2.0;\n"
        "    ELSE:\n"
        "      T4_l_float[]\n"
        "         = T2_l_float[]\n"
        "         + 100.0;\n"
    ) in text.replace("T3_l_float[]\n         = T2", "T4_l_float[]\n         = T2"), text


def test_the_flat_program_has_an_if_instruction():
    c, _ = _loop_with_branches(lambda i: ir.compare("<", i, 3))
    program = flat.compile_program(c, None)
    dump = program.dump()
    assert "if cond=( $" in dump and "< 3 )" in dump, dump
    (instr,) = [ins for ins in program.instrs if ins.op == "if"]
    assert instr.fields["end"] < instr.fields["else_end"]


def _branch_on_input(dtype: torch.dtype):
    """out = x * 2 if the scalar input holds (bool) or is non-zero (int),
    else a copy of x; the branch's own temporary stays inside it."""
    c = HostIrContainer()
    n = ir.Scalar.symbolic(c)
    x, out = _vector(c, n), _vector(c, n)
    flag = ir.InputScalar(c, dtype)
    c.add_input(x)
    c.add_input(flag)
    c.push_back(ir.Allocate(out))
    tmp = _vector(c, n)
    c.push_back(
        ir.IfThenElse(
            flag,
            [ir.BinaryOp(tmp, "mul", x, ir.Scalar.constant(2.0)), ir.Set(out, tmp)],
            [ir.Set(out, x)],
        )
    )
    c.add_output(out)
    c.verify()
    return c, x, flag


@pytest.mark.parametrize("dtype, values", [(torch.bool, [True, False]), (torch.int64, [3, 0, -1])])
def test_condition_on_a_program_input(dtype, values, evaluator_class):
    c, x, flag = _branch_on_input(dtype)
    assert "IF b" in str(c) or "IF i" in str(c)
    assert check_races(c) == []
    t = torch.randn(5)
    ev = evaluator_class(c)
    for v in values:
        (out,) = ev.run({x: t, flag: v})
        torch.testing.assert_close(out, t * 2 if v else t)


def test_a_scalar_input_of_the_wrong_type_is_refused(evaluator_class):
    c, x, flag = _branch_on_input(torch.bool)
    with pytest.raises(Exception, match="bool|takes a torch.bool|must be bound"):
        evaluator_class(c).run({x: torch.randn(3), flag: "yes"})


def test_integer_scalar_inputs_run_in_cpp_and_float_ones_say_why_not(evaluator):
    """Through fd.execute: an integer scalar operand runs on either
    evaluator; a float scalar keeps the program on the Python evaluator,
    and asking for the C++ one says why."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        k = fd.define_scalar(int)
        fd.add_output(fd.ops.mul(x, k))
    t = torch.randn(3, 4)
    for v in (3, -2):
        torch.testing.assert_close(fd.execute([t, v])[0], t * v)
    assert flat.unsupported(fd.host_program()) is None
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.define_scalar(float)
        fd.add_output(fd.ops.mul(x, a))
    assert "of a floating type" in flat.unsupported(fd.host_program())
    if evaluator == "python":
        torch.testing.assert_close(fd.execute([t, 1.5])[0], t * 1.5)
    else:
        with pytest.raises(hostir.HostIrError, match="of a floating type"):
            fd.execute([t, 1.5])


def test_a_bool_input_an_op_computes_with_runs_in_python():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=torch.int64)
        b = fd.define_scalar(bool)
        fd.add_output(fd.ops.add(x, b))
    assert "computes with a bool scalar input" in flat.unsupported(fd.host_program())


def test_a_tensor_defined_in_a_branch_is_not_visible_after_it():
    c, x, flag = _branch_on_input(torch.bool)
    tmp = c.exprs[-1].then_body[0].out
    extra = _vector(c, x.domain[0].extent)
    c.push_back(ir.Set(extra, tmp))
    with pytest.raises(VerifyError, match="is read before it is defined"):
        c.verify()


def test_unknown_comparison_is_refused():
    with pytest.raises(ir.DefinitionError, match="unknown op"):
        ir.compare("<>", ir.Scalar(label="i"), 1)
