"""`fd.ops.broadcast(x, is_broadcast_dim)`, nvFuser's spelling: against
torch's unsqueeze at the True positions, the same program as the
`broadcast_in_dim` it is, its errors (before anything is built), its
gradient (gradcheck in float64), and golden dumps of nvFuser's
RSMatmulTest programs that use it, lowered for rank 0 as a ring and as a
Reduce per row block (run under mpirun in
tests/python/multidevice/test_nvfuser_rs_matmul.py)."""

from __future__ import annotations

import pytest
import torch

from hostir import DefinitionError, FusionDefinition, ParallelType, UsageError
from hostir.errors import DefinitionTypeError
from hostir.lower import lower
from hostir.lower.schedule import Schedule

from conftest import check_golden
from multidevice.test_nvfuser_rs_matmul import reduce_scatter_p2p, reduce_scatter_reduce_based

F64 = torch.float64


def unsqueezed(x: torch.Tensor, flags) -> torch.Tensor:
    """Eager torch: x with a size-1 axis at each True position."""
    for j, new in enumerate(flags):
        if new:
            x = x.unsqueeze(j)
    return x


PATTERNS = {
    "outer": ([True, False, False], [3, 4]),
    "middle": ([False, True, False], [3, 4]),
    "inner": ([False, False, True], [3, 4]),
    "two_new": ([True, False, True, False], [3, 4]),
    "two_new_adjacent": ([False, True, True, False], [3, 4]),
    "nvfuser_rs": ([False, True, False, False], [2, 3, 5]),
    "matmul_rs_through_bcast": ([True, False, True, False, False], [2, 3, 5]),
    "none_new": ([False, False], [3, 4]),
    "scalar_to_1x1": ([True, True], []),
}


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "fixed"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_broadcast_is_unsqueeze(name, symbolic, device):
    flags, shape = PATTERNS[name]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape) if symbolic else shape)
        y = fd.ops.broadcast(x, flags)
        fd.add_output(y)
    assert [d.is_broadcast for d in y.logical_runtime()] == flags
    x_t = torch.randn(tuple(shape), device=device)
    (out,) = fd.execute([x_t])
    torch.testing.assert_close(out, unsqueezed(x_t, flags))


def test_broadcast_feeds_an_op_that_expands_it(device):
    """The new size-1 axis broadcasts against a full one, as in torch."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        z = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.add(fd.ops.broadcast(x, [False, True, False]), z))
    x_t, z_t = torch.randn(3, 5, device=device), torch.randn(3, 4, 5, device=device)
    torch.testing.assert_close(fd.execute([x_t, z_t])[0], x_t.unsqueeze(1) + z_t)


def test_a_size_one_input_axis_stays_a_broadcast_axis(device):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 1])
        y = fd.ops.broadcast(x, [True, False, False])
        fd.add_output(y)
    assert [d.is_broadcast for d in y.logical_runtime()] == [True, False, True]
    x_t = torch.randn(3, 1, device=device)
    torch.testing.assert_close(fd.execute([x_t])[0], x_t.unsqueeze(0))


@pytest.mark.parametrize("axis", [0, 1, 2], ids=["kept", "new", "kept_inner"])
def test_stream_axis_on_a_kept_or_new_axis(axis, device):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        z = fd.define_tensor([-1, 4, -1])
        y = fd.ops.mul(fd.ops.broadcast(x, [False, True, False]), z)
        fd.add_output(y)
    y.axis(axis).parallelize(ParallelType.stream)
    assert fd.host_ir().count("FOR StreamIdx") == 1
    x_t, z_t = torch.randn(3, 5, device=device), torch.randn(3, 4, 5, device=device)
    (out,) = fd.execute([x_t, z_t], number_of_streams=2)
    torch.testing.assert_close(out, x_t.unsqueeze(1) * z_t)


def test_broadcast_is_the_broadcast_in_dim_it_names():
    """The same op, the same program: 1 at the new axes, the input's sizes
    (-1) at the kept ones, the kept ones' positions as the dims."""

    def program(spell):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, 3])
            fd.add_output(spell(fd, x))
        return fd.host_ir()

    by_broadcast = program(lambda fd, x: fd.ops.broadcast(x, [True, False, True, False]))
    by_broadcast_in_dim = program(lambda fd, x: fd.ops.broadcast_in_dim(x, [1, -1, 1, -1], [1, 3]))
    assert by_broadcast == by_broadcast_in_dim
    assert "broadcast_in_dim( T0_g_float[iS0{i0}, iS1{3}], dims = {1, 3} )" in by_broadcast
    assert "T1_g_float[bS2{1}, iS3{i0}, bS4{1}, iS5{3}]" in by_broadcast


def test_golden_of_a_stream_parallel_broadcast():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        z = fd.define_tensor([-1, -1, -1])
        y = fd.ops.mul(fd.ops.broadcast(x, [False, True, False]), z)
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.stream)
    check_golden("broadcast_spelling_stream", lower(fd.fusion))


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "flags, message",
    [
        ([True, False], r"is_broadcast_dim \[True, False\] \(length 2\) must have one False entry per axis of T0: "
         r"expected 2 False entries, got 1"),
        ([False, False, False], r"\(length 3\) must have one False entry per axis of T0: expected 2 False entries, got 3"),
        ([True, True], r"\(length 2\) .* expected 2 False entries, got 0"),
        ([], r"\(length 0\) .* expected 2 False entries, got 0"),
    ],
)  # fmt: skip
def test_a_wrong_number_of_kept_axes_is_refused(flags, message):
    with pytest.raises(DefinitionError, match=message):
        with FusionDefinition() as fd:
            fd.ops.broadcast(fd.define_tensor([2, 3]), flags)


@pytest.mark.parametrize(
    "flags",
    [[1, 0, 0], [True, 0, False], "TFF", 3, None, (f for f in [True, False, False])],
    ids=["ints", "mixed", "string", "int", "none", "generator"],
)
def test_flags_that_are_not_a_list_of_bools_are_refused(flags):
    with pytest.raises(DefinitionTypeError, match="broadcast: is_broadcast_dim must be a list of bools"):
        with FusionDefinition() as fd:
            fd.ops.broadcast(fd.define_tensor([2, 3]), flags)


def test_a_tuple_of_bools_is_taken():
    with FusionDefinition() as fd:
        y = fd.ops.broadcast(fd.define_tensor([2, 3]), (False, True, False))
        fd.add_output(y)
    x_t = torch.randn(2, 3)
    torch.testing.assert_close(fd.execute([x_t])[0], x_t.unsqueeze(1))


def test_a_refused_broadcast_builds_nothing():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3])
        before = (fd.fusion.version, dict(fd.fusion._counters))
        with pytest.raises(DefinitionError):
            fd.ops.broadcast(x, [True, False])
        with pytest.raises(DefinitionTypeError):
            fd.ops.broadcast(x, [1, 0, 0])
        # No op, no tensor, no axis: every name counter where it was.
        assert (fd.fusion.version, dict(fd.fusion._counters)) == before
        fd.add_output(fd.ops.broadcast(x, [False, False, True]))
    x_t = torch.randn(2, 3)
    torch.testing.assert_close(fd.execute([x_t])[0], x_t.unsqueeze(2))


def test_broadcast_takes_a_tensor_of_its_own_fusion_inside_the_with_block():
    with pytest.raises(DefinitionTypeError, match="broadcast takes a TensorView, got Tensor"):
        with FusionDefinition() as fd:
            fd.ops.broadcast(torch.zeros(2), [True, False])
    with FusionDefinition() as other:
        foreign = other.define_tensor([2])
        other.add_output(other.ops.set(foreign))
    with pytest.raises(DefinitionError, match="belongs to another FusionDefinition"):
        with FusionDefinition() as fd:
            fd.ops.broadcast(foreign, [True, False])
    with pytest.raises(UsageError, match="inside `with FusionDefinition"):
        other.ops.broadcast(foreign, [True, False])


# ---------------------------------------------------------------- gradient


def _gradcheck(fd, *inputs):
    def run(*xs):
        return tuple(fd.execute(list(xs), evaluator="python"))

    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", ["outer", "middle", "inner", "two_new", "nvfuser_rs"])
def test_gradient_sums_over_the_expanded_new_axes(name):
    """broadcast's transpose is broadcast_in_dim's: the cotangent summed
    over the new axes (grown by the mul against a full tensor)."""
    flags, shape = PATTERNS[name]
    full = [4 if f else s for f, s in zip(flags, _interleave(flags, shape))]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape), F64)
        z = fd.define_tensor([-1] * len(full), F64)
        fd.add_output(fd.ops.mul(fd.ops.broadcast(x, flags), z))
    x_t = torch.randn(tuple(shape), dtype=F64, requires_grad=True)
    _gradcheck(fd, x_t, torch.randn(tuple(full), dtype=F64, requires_grad=True))


def test_gradient_through_the_nvfuser_rs_matmul_on_one_device():
    """nvFuser's ReduceScatterP2p on one device: sum_d A[d] @ B[d]."""
    D, m, k, n = 2, 3, 4, 5
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1, -1, -1], F64)
        b = fd.define_tensor([-1, -1, -1], F64)
        partials = fd.ops.matmul(a, fd.ops.broadcast(b, [False, True, False, False]))
        fd.add_output(fd.ops.sum(partials, [0]))
    a_t = torch.randn(D, D, m, k, dtype=F64, requires_grad=True)
    b_t = torch.randn(D, k, n, dtype=F64, requires_grad=True)
    (out,) = fd.execute([a_t, b_t])
    torch.testing.assert_close(out, torch.matmul(a_t, b_t.unsqueeze(1)).sum(0))
    _gradcheck(fd, a_t, b_t)


def _interleave(flags, shape):
    """The output sizes: 1 at each True, the next input size at each False."""
    sizes = iter(shape)
    return [1 if f else next(sizes) for f in flags]


# ------------------------------------------------- nvFuser's RSMatmulTest, golden
# The programs tests/python/multidevice/test_nvfuser_rs_matmul.py runs under
# mpirun, lowered for rank 0 of 2.


@pytest.mark.parametrize(
    "name, program, sched",
    [
        ("nvfuser_rs_p2p_ring", "p2p", Schedule("ring")),
        # nvFuser's own partials layout lowers to the very same program.
        ("nvfuser_rs_p2p_ring", "p2p, nvFuser's partials", Schedule("ring")),
        ("nvfuser_rs_reduce_based_collective", "reduce-based", Schedule("collective")),
        ("nvfuser_rs_reduce_based_sequential", "reduce-based", Schedule("sequential")),
    ],
)
def test_golden_of_nvfusers_rs_matmul(name, program, sched):
    if program == "reduce-based":
        fd = reduce_scatter_reduce_based(2, "input")[0]
    else:
        fd = reduce_scatter_p2p(2, partials="nvfuser" if "nvFuser" in program else "hostir")[0]
    check_golden(name, lower(fd.fusion, rank=0, backend="gloo", schedule=sched))
