"""Sharded matmuls with torch's broadcasting, every placement of mesh_x and
stream axes on operands and product, dry-run for two ranks: each ends in a
plan or a `hostir.HostIrError` that names the problem, never an internal
error (an IndexError, a RuntimeError from a reshape, an AttributeError)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from hostir.mesh_extents import MeshExtentError

D = 2
FORMS = [
    ([-1, -1], [-1, -1, -1]),
    ([1, -1, -1, -1], [-1, 1, -1, -1]),
    ([-1, -1, -1, -1], [-1, -1, -1]),
    ([-1, -1, -1], [-1, -1]),
    ([-1, -1, -1], [-1, -1, -1]),
]
# Warnings are errors here: torch resizing an op's output buffer means the
# op was handed operands of the wrong shape.
INTERNAL = (
    "IndexError", "AttributeError", "KeyError", "TypeError", "RuntimeError: shape", "is invalid for input", "resized",
)


def _whole(shape, rows_per_axis):
    return [1 if s == 1 else (D if i < len(shape) - 2 else rows_per_axis) for i, s in enumerate(shape)]


@st.composite
def programs(draw):
    a_shape, b_shape = draw(st.sampled_from(FORMS))
    n_out = max(len(a_shape), len(b_shape))
    pick = lambda n: draw(st.one_of(st.none(), st.integers(0, n - 1)))  # noqa: E731
    return a_shape, b_shape, pick(len(a_shape)), pick(len(b_shape)), pick(n_out), pick(n_out), draw(st.sampled_from([2, 4]))


@pytest.mark.filterwarnings("error")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_every_placement_plans_or_names_its_error(program):
    a_shape, b_shape, sa, sb, so, stream, rows = program
    with FusionDefinition() as fd:
        a = fd.define_tensor(a_shape)
        b = fd.define_tensor(b_shape)
        c = fd.ops.matmul(a, b)
        fd.add_output(c)
    mesh = DeviceMesh(range(D))
    for tv in (a, b, c):
        tv.set_device_mesh(mesh)
    for tv, axis in ((a, sa), (b, sb), (c, so)):
        if axis is not None:
            tv.axis(axis).parallelize(ParallelType.mesh_x)
    if stream is not None and stream != so:
        c.axis(stream).parallelize(ParallelType.stream)
    A, B = torch.randn(_whole(a_shape, rows)), torch.randn(_whole(b_shape, rows))
    try:
        inputs = [shard_tensor(A, a, rank=0), shard_tensor(B, b, rank=0)]
        fd.dry_run(inputs, world_size=D)
    except hostir.HostIrError as err:
        assert not any(word in str(err) for word in INTERNAL), str(err)


def test_sharding_rows_a_replicated_input_has_too_many_of_is_named():
    """The product's rows on mesh_x without a split: they must number the
    mesh's size; for more rows the error says so before anything runs."""
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1, -1])
        c = fd.ops.matmul(a, b)
        fd.add_output(c)
    for tv in (a, b, c):
        tv.set_device_mesh(DeviceMesh(range(D)))
    c.axis(1).parallelize(ParallelType.mesh_x)
    with pytest.raises(hostir.DryRunError, match="MeshExtentError: axis 1 of T2.* size must be 2, but it is 4"):
        fd.dry_run([torch.randn(4, 3), torch.randn(D, 3, 5)], world_size=D)
    assert issubclass(MeshExtentError, hostir.HostIrError)
    fd.dry_run([torch.randn(D, 3), torch.randn(D, 3, 5)], world_size=D)


@st.composite
def linears(draw):
    x_shape = draw(st.sampled_from([[-1, -1], [-1, -1, -1]]))
    w_shape = draw(st.sampled_from([[-1, -1], [D, -1, -1]]))
    b_shape = draw(st.sampled_from([None, [-1], [-1, -1][: len(w_shape) - 1]]))
    n_out = len(x_shape) - 1 + len(w_shape) - 1
    pick = lambda n: draw(st.one_of(st.none(), st.integers(0, n - 1)))  # noqa: E731
    placements = (pick(len(x_shape)), pick(len(w_shape)), pick(len(b_shape)) if b_shape else None, pick(n_out))
    return x_shape, w_shape, b_shape, placements, pick(n_out)


@pytest.mark.filterwarnings("error")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(linears())
def test_every_linear_placement_plans_or_names_its_error(program):
    x_shape, w_shape, b_shape, (sx, sw, sb, so), stream = program
    with FusionDefinition() as fd:
        x = fd.define_tensor(x_shape)
        w = fd.define_tensor(w_shape)
        b = fd.define_tensor(b_shape) if b_shape else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, w, b, y):
        if tv is not None:
            tv.set_device_mesh(mesh)
    for tv, axis in ((x, sx), (w, sw), (b, sb), (y, so)):
        if axis is not None:
            tv.axis(axis).parallelize(ParallelType.mesh_x)
    if stream is not None and stream != so:
        y.axis(stream).parallelize(ParallelType.stream)
    whole = [torch.randn([D] * (len(x_shape) - 1) + [4]), torch.randn([D] * (len(w_shape) - 1) + [4])]
    tvs = [x, w]
    if b_shape:
        whole.append(torch.randn([D] * len(b_shape)))
        tvs.append(b)
    try:
        fd.dry_run([shard_tensor(t, tv, rank=0) for t, tv in zip(whole, tvs)], world_size=D)
    except hostir.HostIrError as err:
        assert not any(word in str(err) for word in INTERNAL), str(err)
