"""permute and reshape as views: the evaluator binds torch's view, the race
checker sees the view as its operand's buffer, and the dry run's memory
plan counts no copy for it."""

from __future__ import annotations

import torch

from hostir import FusionDefinition, check_races, ir
from hostir.container import HostIrContainer
from hostir.runtime.evaluator import HostIrEvaluator


def _peak(build, shape=(64, 32)) -> int:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(build(fd, x), 2.0))
    report = fd.dry_run([torch.empty(shape)])
    x = torch.randn(shape)
    (out,) = fd.execute([x])
    return report[0].peak_bytes, out, x


def test_a_view_costs_no_memory_in_the_plan():
    copy_peak, _, _ = _peak(lambda fd, x: fd.ops.set(x))
    view_peak, out, x = _peak(lambda fd, x: fd.ops.permute(x, [1, 0]))
    torch.testing.assert_close(out, x.permute(1, 0) * 2.0)
    buffer = 64 * 32 * 4
    assert copy_peak - view_peak == buffer, (copy_peak, view_peak)
    reshape_peak, out, x = _peak(lambda fd, x: fd.ops.reshape(x, [32, 64]))
    torch.testing.assert_close(out, x.reshape(32, 64) * 2.0)
    assert reshape_peak == view_peak


def test_a_reshape_torch_must_copy_is_counted():
    view_peak, _, _ = _peak(lambda fd, x: fd.ops.permute(x, [1, 0]))
    copied_peak, out, x = _peak(lambda fd, x: fd.ops.reshape(fd.ops.permute(x, [1, 0]), [-1]))
    torch.testing.assert_close(out, x.permute(1, 0).reshape(-1) * 2.0)
    assert copied_peak == view_peak + 64 * 32 * 4


def _view_then_overwrite(kind: str, synchronized: bool):
    """buf = x; v = view(buf); on a worker stream out = v * 1; back on the
    caller's stream buf = x + 1 (a write into buf's buffer), with or
    without waiting for the worker first."""
    c = HostIrContainer()
    n = ir.Scalar.symbolic(c)
    m = ir.Scalar.symbolic(c)

    def tensor(extents, memory=ir.MemoryType.global_):
        return ir.TensorView(c, [ir.IterDomain(c, e) for e in extents], torch.float32, memory)

    x, buf = tensor([n, m]), tensor([n, m])
    view = tensor([m, n] if kind == "permute" else [ir.ScalarExpr("*", n, m)], ir.MemoryType.local)
    out = tensor([d.extent for d in view.domain])
    c.add_input(x)
    caller, worker = ir.Stream(c), ir.Stream(c, ir.Scalar.constant(1))
    op = ir.PermuteOp(view, buf, (1, 0)) if kind == "permute" else ir.ReshapeOp(view, buf, (-1,))
    body = [
        ir.GetCurrentStream(caller),
        ir.Allocate(buf),
        ir.Set(buf, x),
        op,
        ir.SetCurrentStream(worker),
        ir.Synchronize(caller),
        ir.BinaryOp(out, "mul", view, ir.Scalar.constant(1.0)),
        ir.SetCurrentStream(caller),
    ]
    if synchronized:
        body.append(ir.Synchronize(worker))
    body.append(ir.BinaryOp(buf, "add", x, ir.Scalar.constant(1.0)))
    for e in body:
        c.push_back(e)
    c.add_output(out)
    c.verify()
    return c, x


def test_the_race_checker_sees_a_view_as_its_operand():
    for kind in ("permute", "reshape"):
        c, _ = _view_then_overwrite(kind, synchronized=False)
        races = check_races(c)
        assert races, kind
        # The read is of the view T2; the race is on its operand's buffer.
        assert [r.buffer for r in races] == ["T1"], [str(r) for r in races]
        c, x = _view_then_overwrite(kind, synchronized=True)
        assert check_races(c) == [], kind
        t = torch.randn(3, 4)
        (result,) = HostIrEvaluator(c).run({x: t})
        torch.testing.assert_close(result, t.permute(1, 0) if kind == "permute" else t.reshape(-1))


def test_streamed_shape_programs_stay_race_free_with_views():
    """The shape-op programs (permutes and reshapes feeding stream loops,
    a scalar input among them) check clean with views as their operands'
    buffers."""
    import test_shape_ops

    for name, build in test_shape_ops.CASES.items():
        fd, _, _ = test_shape_ops._define(build)
        assert check_races(fd.host_program()) == [], name


def test_views_on_repeated_calls_and_into_preallocated_outputs():
    """The fast path of a repeated call returns the views too; preallocated
    outputs (a reshape's inferred size included) are written, not viewed."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.permute(x, [1, 0]))
        fd.add_output(fd.ops.mul(fd.ops.reshape(x, [-1]), 2.0))
    for _ in range(3):
        t = torch.randn(3, 4)
        permuted, doubled = fd.execute([t])
        assert permuted.data_ptr() == t.data_ptr()
        torch.testing.assert_close(permuted, t.permute(1, 0))
        torch.testing.assert_close(doubled, t.reshape(-1) * 2.0)
    t = torch.randn(3, 4)
    out = [torch.empty(4, 3), torch.empty(12)]
    fd.execute([t], outputs=out)
    torch.testing.assert_close(out[0], t.permute(1, 0))
    torch.testing.assert_close(out[1], t.reshape(-1) * 2.0)
    assert fd.num_programs == 1
