"""`broadcast_in_dim` and `expand` on one device: against torch's
unsqueeze/expand, whole, with a stream axis on a kept or a new axis, and
their errors (at definition where sizes are known, before any op runs
where they are symbolic)."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import DefinitionError, FusionDefinition, ParallelType
from hostir.errors import DefinitionIndexError
from hostir.runtime import flat

STREAM = ParallelType.stream


def _program(build):
    with FusionDefinition() as fd:
        outs = build(fd)
        for out in outs:
            fd.add_output(out)
    return fd, outs


def test_broadcast_in_dim_adds_and_grows_axes():
    def build(fd):
        x = fd.define_tensor([-1, 1])
        y = fd.ops.broadcast_in_dim(x, [-1, 4, 6], [0, 2])
        return [fd.ops.mul(y, 2.0)]

    fd, (y,) = _program(build)
    x = torch.randn(3, 1)
    (out,) = fd.execute([x])
    torch.testing.assert_close(out, x.unsqueeze(1).expand(3, 4, 6) * 2.0)
    assert "broadcast_in_dim( T0_g_float[iS0{i0}, bS1{1}], dims = {0, 2} )" in fd.host_ir()


def test_new_size_one_axis_is_a_broadcast_axis():
    def build(fd):
        x = fd.define_tensor([-1, -1])
        b = fd.ops.broadcast_in_dim(x, [1, -1, -1], [1, 2])
        y = fd.define_tensor([-1, -1, -1])
        return [fd.ops.add(y, b)]

    fd, _ = _program(build)
    x, y = torch.randn(3, 5), torch.randn(2, 3, 5)
    torch.testing.assert_close(fd.execute([x, y])[0], y + x)


def test_expand_as_torch():
    def build(fd):
        return [fd.ops.expand(fd.define_tensor([-1, 1, -1]), [-1, 4, -1])]

    fd, _ = _program(build)
    x = torch.randn(2, 1, 3)
    (out,) = fd.execute([x])
    torch.testing.assert_close(out, x.expand(2, 4, 3))
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("axis", [0, 1, 2], ids=["kept", "new", "kept_inner"])
def test_stream_axis_on_a_kept_or_new_axis(axis, device):
    def build(fd):
        x = fd.define_tensor([-1, -1])
        y = fd.ops.broadcast_in_dim(x, [-1, 4, -1], [0, 2])
        return [fd.ops.add(y, 1.0)]

    fd, (z,) = _program(build)
    z.axis(axis).parallelize(STREAM)
    assert fd.host_ir().count("FOR StreamIdx") == 1
    x = torch.randn(3, 5, device=device)
    (out,) = fd.execute([x], number_of_streams=2)
    torch.testing.assert_close(out, x.unsqueeze(1).expand(3, 4, 5) + 1.0)


def test_the_cpp_executor_leaves_broadcast_to_the_python_evaluator(monkeypatch):
    monkeypatch.setenv("HOSTIR_EVALUATOR", "auto")

    def build(fd):
        return [fd.ops.broadcast_in_dim(fd.define_tensor([-1]), [2, -1], [1])]

    fd, _ = _program(build)
    assert "no instruction for BroadcastInDimOp" in flat.unsupported(fd.host_program())
    x = torch.randn(5)
    torch.testing.assert_close(fd.execute([x])[0], x.expand(2, 5))


@pytest.mark.parametrize(
    "shape, dims, message",
    [
        ([4, 3], [0, 1], "axis 0 of T0 has size 2, not 4; only a size-1 axis grows"),
        ([2, 3, 4], [0], "must name one output axis for each of the 2 axes"),
        ([2, 3], [1, 0], "must be increasing and distinct"),
        ([2, 3], [0, 2], "output axis 2 is out of range"),
        ([2, -1, 3], [0, 2], "shape\\[1\\] = -1 but output axis 1 is new"),
        ([2, 3, -2], [0, 1], "shape\\[2\\] = -2"),
    ],
)
def test_bad_broadcast_in_dim_is_refused_at_definition(shape, dims, message):
    with pytest.raises((DefinitionError, DefinitionIndexError), match=message):
        with FusionDefinition() as fd:
            fd.ops.broadcast_in_dim(fd.define_tensor([2, 3]), shape, dims)


def test_expand_of_a_wide_axis_is_refused():
    with pytest.raises(DefinitionError, match="only a size-1 axis grows"):
        with FusionDefinition() as fd:
            fd.ops.expand(fd.define_tensor([2, 3]), [2, 6])
    with pytest.raises(DefinitionError, match="must have the 2 axes"):
        with FusionDefinition() as fd:
            fd.ops.expand(fd.define_tensor([2, 3]), [2, 3, 1])


def test_a_symbolic_size_that_differs_is_refused_before_running():
    def build(fd):
        return [fd.ops.broadcast_in_dim(fd.define_tensor([-1, -1]), [2, 3, 5], [0, 1])]

    fd, _ = _program(build)
    with pytest.raises(hostir.HostIrError, match="axis 0 of T0 has size 4, but output axis 0 is 2"):
        fd.execute([torch.randn(4, 3)])
    x = torch.randn(2, 3)
    torch.testing.assert_close(fd.execute([x])[0], x.unsqueeze(-1).expand(2, 3, 5))
