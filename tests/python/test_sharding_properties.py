"""Property tests of sharding invariants: a whole tensor cut by
`shard_tensor` on any 1-D or 2-D mesh reassembles from the ranks' pieces;
extents that ops make equal are equal by structure; the resharding cost
comparison is antisymmetric."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from hostir import axis_graph, ir
from hostir.lower.insert_reshardings import _compare


@st.composite
def sharded_inputs(draw):
    ny = draw(st.integers(1, 3))
    nx = draw(st.integers(1, 3))
    two_d = draw(st.booleans())
    mesh = DeviceMesh(torch.arange(ny * nx).reshape(ny, nx)) if two_d else DeviceMesh(range(nx))
    ndim = draw(st.integers(2, 3))
    types = [ParallelType.mesh_x] + ([ParallelType.mesh_y] if two_d else [])
    axes = draw(st.lists(st.integers(0, ndim - 1), min_size=len(types), max_size=len(types), unique=True))
    rows = [draw(st.integers(1, 3)) for _ in range(ndim)]
    return mesh, dict(zip(types, axes)), rows


@settings(max_examples=60, deadline=None)
@given(sharded_inputs())
def test_pieces_reassemble_the_whole_tensor(case):
    mesh, sharding, rows = case
    shape = list(rows)
    for pt, axis in sharding.items():
        shape[axis] *= mesh.size_along(pt)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1] * len(shape))
        fd.add_output(fd.ops.set(x))
    x.set_device_mesh(mesh)
    # Split in decreasing axis order so earlier axes keep their index.
    for pt, axis in sorted(sharding.items(), key=lambda item: -item[1]):
        x.outer_split(axis, mesh.size_along(pt))
        x.axis(axis).parallelize(pt)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    pieces = {r: shard_tensor(full, x, rank=r) for r in mesh.devices}
    for piece in pieces.values():
        assert list(piece.shape) == rows
    # Put the pieces back along each sharded axis, mesh_x's pieces first.
    for r, piece in pieces.items():
        index = [slice(None)] * len(shape)
        for pt, axis in sharding.items():
            at = mesh.index_along(r, pt)
            index[axis] = slice(at * rows[axis], (at + 1) * rows[axis])
        assert torch.equal(full[tuple(index)], piece)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.data())
def test_extents_joined_by_ops_are_one_class(n, data):
    """A chain of adds over some of n [-1] inputs makes their extents one
    class; the others stay apart."""
    joined = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=n, unique=True))
    with FusionDefinition() as fd:
        xs = [fd.define_tensor(shape=[-1]) for _ in range(n)]
        acc = xs[joined[0]]
        for i in joined[1:]:
            acc = fd.ops.add(acc, xs[i])
        fd.add_output(acc)
        for i in range(n):
            if i not in joined:
                fd.add_output(fd.ops.neg(xs[i]))
    classes = axis_graph.ExtentClasses(fd.fusion.exprs)
    extents = [x.axis(0).extent for x in xs]
    for i in range(n):
        for j in range(n):
            same = i == j or (i in joined and j in joined)
            assert classes.same(extents[i], extents[j]) == same
            # A split of each by 2 compares the same way, by structure.
            a = ir.ScalarExpr("/", extents[i], ir.Scalar.constant(2))
            b = ir.ScalarExpr("/", extents[j], ir.Scalar.constant(2))
            assert classes.same(a, b) == same


sizes = st.tuples(st.integers(1, 64), st.dictionaries(st.sampled_from("abc"), st.integers(1, 2)).map(Counter))


@given(sizes, sizes)
def test_size_comparison_is_antisymmetric(a, b):
    flipped = {"<": ">", ">": "<", "=": "=", "?": "?"}
    assert _compare(a, b) == flipped[_compare(b, a)]
    if not a[1] and not b[1]:
        assert _compare(a, b) != "?"
