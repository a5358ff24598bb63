"""The shape arithmetic of layout.py: element counts against torch's,
the extents a rank holds of a sharded or streamed tensor, the bytes of a
constant buffer, and the printed product of extents."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostir import DeviceMesh, ParallelType, ir, layout

_SHAPES = st.lists(st.integers(0, 6), min_size=0, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shape=_SHAPES)
def test_numel_is_torchs(shape):
    assert layout.numel(shape) == torch.empty(shape).numel()
    assert layout.numel(torch.Size(shape)) == math.prod(shape)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    target=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    inferred=st.one_of(st.none(), st.integers(0, 3)),
)
def test_reshape_numel_holds_the_input_exactly_where_torch_reshapes(shape, target, inferred):
    """`reshape_numel(target, n) == n` is the evaluator's check that a
    reshape fits: it must hold exactly where torch's reshape succeeds."""
    if inferred is not None:
        target[inferred % len(target)] = -1
    t = torch.randn(shape)
    try:
        t.reshape(target)
        fits = True
    except RuntimeError:
        fits = False
    assert (layout.reshape_numel(target, t.numel()) == t.numel()) == fits


def _fusion_tensor(shape, dtype=torch.float32) -> tuple[ir.Fusion, ir.TensorView]:
    fusion = ir.Fusion()
    return fusion, fusion.new_tensor(shape, dtype)


def test_product_prints_the_left_nested_product():
    fusion, tv = _fusion_tensor([-1, -1, 5])
    a, b, c = (d.extent for d in tv.domain)
    assert ir.format_scalar(layout.product([a, b, c])) == f"( ( {a.label} * {b.label} ) * 5 )"
    empty = layout.product([])
    assert empty.is_constant and empty.value == 1
    assert layout.product([a]) is a


def test_a_rank_holds_one_index_of_a_mesh_x_piece():
    _, tv = _fusion_tensor([8, 6])
    tv.set_device_mesh(DeviceMesh([0, 1]))
    tv.outer_split(0, 2)
    tv.axis(0).parallelize(ParallelType.mesh_x)
    extents = layout.local_loop_extents(tv)
    assert [e.value for e in extents] == [1, 4, 6]
    # 4 rows of 6 float32 on each rank.
    assert layout.constant_bytes(tv) == 4 * 6 * 4
    assert layout.local_shape(tv, lambda s: s.value) == [1, 4, 6]


def test_constant_bytes_needs_every_extent_constant():
    _, tv = _fusion_tensor([-1, 6], torch.bfloat16)
    assert layout.constant_bytes(tv) is None
    _, tv = _fusion_tensor([3, 6], torch.bfloat16)
    assert layout.constant_bytes(tv) == 3 * 6 * 2


def test_an_allocation_counts_a_streamed_axis_whole():
    """A stream split keeps its pieces in one runtime dim: the allocation
    counts the axis's whole extent, not the product of its pieces (which,
    for a symbolic extent, is a ceilDiv times the factor)."""
    _, tv = _fusion_tensor([-1, 6])
    whole = tv.axis(0).extent
    tv.outer_split(0, 3)
    tv.axis(0).parallelize(ParallelType.stream)
    extents = layout.allocated_extents(tv)
    assert extents[0] is whole and extents[1].value == 6
    # A mesh_x piece is a dim of its own: counted as a piece.
    _, tv = _fusion_tensor([8, 6])
    tv.set_device_mesh(DeviceMesh([0, 1]))
    tv.outer_split(0, 2)
    tv.axis(0).parallelize(ParallelType.mesh_x)
    assert [e.value for e in layout.allocated_extents(tv)] == [2, 4, 6]


def test_shard_count_multiplies_the_mesh_along_every_sharded_piece():
    mesh = DeviceMesh([[0, 1, 2], [3, 4, 5]])  # 2 along mesh_y, 3 along mesh_x
    _, tv = _fusion_tensor([12, 3, 5])
    tv.set_device_mesh(mesh)
    tv.outer_split(0, 2)
    tv.axis(0).parallelize(ParallelType.mesh_y)
    tv.outer_split(1, 3)
    tv.axis(1).parallelize(ParallelType.mesh_x)
    tv.axis(3).parallelize(ParallelType.mesh_x)
    rows, cols, rest = tv.logical_runtime()
    assert layout.shard_count(mesh, rows) == 6
    assert layout.device_types(rows) == {ParallelType.mesh_x, ParallelType.mesh_y}
    assert layout.shard_count(mesh, cols) == 3
    assert layout.shard_count(mesh, rest) == 1 and not layout.device_types(rest)
    assert layout.shard_count(None, rows) == 1
    # This rank's rows: 12 whole rows over 6 ranks.
    assert layout.local_size(tv, rows, {}) == 2
