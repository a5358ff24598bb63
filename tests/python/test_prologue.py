"""What a prepared single-device call keeps between calls so that it starts
sooner: the offloaded stack's detached weights (a changed parameter is still
seen on the next call) and the evaluator's extents per shape of the bound
tensors (other shapes are checked, and a wrong extent fails on every run)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hostir
from hostir import ir
from hostir.container import HostIrContainer
from hostir.runtime.evaluator import BindingError, HostIrEvaluator


def _stack(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16, bias=bias), nn.GELU(), nn.Linear(16, 16, bias=bias), nn.ReLU())


@pytest.mark.parametrize("hoist", ["auto", "sequential"])
def test_offloaded_stack_sees_every_kind_of_parameter_update(hoist):
    module = _stack()
    expected = copy.deepcopy(module)
    offloaded = hostir.offload(module, "cpu", hoist=hoist)
    x = torch.randn(5, 16)
    first, second = module[0], module[2]
    with torch.no_grad():
        torch.testing.assert_close(offloaded(x), expected(x))
        kept = offloaded.host_tensors()
        assert all(a is b for a, b in zip(kept, offloaded.host_tensors()))  # kept while nothing changed

        # In place.
        first.weight.mul_(1.5)
        expected[0].weight.mul_(1.5)
        torch.testing.assert_close(offloaded(x), expected(x))

        # New data of the same shape.
        w = torch.randn(16, 16)
        second.weight.data = w.clone()
        expected[2].weight.data = w.clone()
        torch.testing.assert_close(offloaded(x), expected(x))

        # The same memory seen with other strides (a transposed square weight).
        first.weight.data = first.weight.data.t()
        expected[0].weight.data = expected[0].weight.data.t()
        torch.testing.assert_close(offloaded(x), expected(x))

        # A new parameter object, and a new bias.
        b = torch.randn(16)
        second.weight = nn.Parameter(torch.randn(16, 16))
        expected[2].weight = nn.Parameter(second.weight.detach().clone())
        first.bias = nn.Parameter(b.clone())
        expected[0].bias = nn.Parameter(b.clone())
        torch.testing.assert_close(offloaded(x), expected(x))


def test_offloaded_stack_refuses_a_weight_of_another_shape_after_prepared_calls():
    module = _stack(bias=False)
    offloaded = hostir.offload(module, "cpu")
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(3):
            offloaded(x)
        module[2].weight.data = torch.randn(8, 16)
        with pytest.raises(hostir.HostIrError, match="16|8"):
            offloaded(x)


def test_offloaded_stack_takes_another_dtype_and_shape():
    module = _stack()
    expected = copy.deepcopy(module)
    offloaded = hostir.offload(module, "cpu")
    with torch.no_grad():
        for rows in (4, 9, 4):
            x = torch.randn(rows, 16, dtype=torch.float64)
            torch.testing.assert_close(offloaded(x), expected(x.float()))


def _shared_extent():
    """T0[i0] and T1[i0] (one extent), out = T0 + T1."""
    c = HostIrContainer()
    i0 = ir.Scalar.symbolic(c)
    t0 = ir.TensorView(c, [ir.IterDomain(c, i0)], torch.float32, ir.MemoryType.global_)
    t1 = ir.TensorView(c, [ir.IterDomain(c, i0)], torch.float32, ir.MemoryType.global_)
    out = ir.TensorView(c, [ir.IterDomain(c, i0)], torch.float32, ir.MemoryType.global_)
    c.add_input(t0)
    c.add_input(t1)
    c.push_back(ir.BinaryOp(out, "add", t0, t1))
    c.add_output(out)
    return c, t0, t1


def test_evaluator_keeps_extents_per_shape_and_checks_other_shapes():
    c, t0, t1 = _shared_extent()
    ev = HostIrEvaluator(c)
    a, b = torch.randn(5), torch.randn(5)
    (out,) = ev.run({t0: a, t1: b})
    torch.testing.assert_close(out, a + b)
    assert len(ev.bound_extents) == 1
    a, b = torch.randn(5), torch.randn(5)
    (out,) = ev.run({t0: a, t1: b})  # from the kept extents
    torch.testing.assert_close(out, a + b)
    assert len(ev.bound_extents) == 1
    # Another shape is checked and kept apart.
    a, b = torch.randn(7), torch.randn(7)
    (out,) = ev.run({t0: a, t1: b})
    torch.testing.assert_close(out, a + b)
    assert len(ev.bound_extents) == 2
    # Extents that disagree fail on every run, and are never kept.
    for _ in range(2):
        with pytest.raises(BindingError, match=r"axis 0 of .* is 7 but its extent .* is 5"):
            ev.run({t0: torch.randn(5), t1: torch.randn(7)})
    assert len(ev.bound_extents) == 2
    # A wrong rank fails too, after shapes that passed.
    with pytest.raises(BindingError, match="has 1 dims"):
        ev.run({t0: torch.randn(5, 1), t1: torch.randn(5)})


def test_evaluator_checks_non_tensor_bindings_every_run():
    c, t0, t1 = _shared_extent()
    ev = HostIrEvaluator(c)
    ev.run({t0: torch.randn(3), t1: torch.randn(3)})
    with pytest.raises(BindingError, match="must be bound to a torch.Tensor"):
        ev.run({t0: torch.randn(3), t1: [1.0, 2.0, 3.0]})


def test_prepared_call_with_a_wrong_extent_takes_the_full_path():
    with hostir.FusionDefinition() as fd:
        a = fd.define_tensor([-1, 4])
        b = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.add(a, b))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(3):
        (out,) = fd.execute([x, y])
        torch.testing.assert_close(out, x + y)
    for _ in range(2):
        with pytest.raises(hostir.HostIrError):
            fd.execute([torch.randn(3, 4), torch.randn(2, 4)])
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    (out,) = fd.execute([x, y])
    torch.testing.assert_close(out, x + y)
