"""Axis graphs: which axes a program's ops iterate together, and which
extents that makes equal.

`Expr.id_pairs()` declares, per op, the (output axis, input axis) pairs
that iterate together on logical axes. This module walks those
declarations: `leaf_pairs` carries them to the loop pieces of split axes,
`IdGraph` joins the axes into groups (the stream and device passes ask
which operand axes a loop axis walks), and `ExtentClasses` joins their
extents (the checks and the resharding pass ask which sizes must be
equal).
"""

from __future__ import annotations

from typing import Iterator, Sequence

from hostir.ir import Expr, IterDomain, Scalar, ScalarExpr, same_scalar, walk


def split_alike(a: IterDomain, b: IterDomain, equal=None) -> bool:
    """Whether logical axes `a` and `b` are split into pieces of the same
    extents, taking the two axes' own extents as equal (they iterate
    together) and, with `equal`, any other extents it declares equal."""

    def leaf_equal(x: Scalar, y: Scalar) -> bool:
        if {id(x), id(y)} == {id(a.extent), id(b.extent)}:
            return True
        return equal is not None and equal(x, y)

    la, lb = a.loop_leaves(), b.loop_leaves()
    return len(la) == len(lb) and all(same_scalar(x.extent, y.extent, leaf_equal) for x, y in zip(la, lb))


def leaf_pairs(e: Expr) -> Iterator[tuple[IterDomain, IterDomain]]:
    """`e.id_pairs()` on loop axes: a pair of logical axes split the same way
    pairs their pieces in order; split differently (a resharding op that
    gathers a split axis whole), they pair nothing."""
    for a, b in e.id_pairs():
        la, lb = a.loop_leaves(), b.loop_leaves()
        if len(la) == 1 and len(lb) == 1:
            yield a, b
        elif split_alike(a, b):
            yield from zip(la, lb)


class ExtentClasses:
    """Which extents a program makes equal: the extents of axes that its
    ops iterate together (broadcasts aside) are one class.
    Sizes in one class are checked equal when the program runs."""

    def __init__(self, exprs: Sequence[Expr]):
        self._parent: dict[int, Scalar] = {}
        self._scalars: dict[int, Scalar] = {}
        for e in walk(exprs):
            for a, b in list(e.id_pairs()) + list(leaf_pairs(e)):
                if not (a.is_broadcast or b.is_broadcast):
                    self._union(a.extent, b.extent)

    def _find(self, s: Scalar) -> Scalar:
        while id(s) in self._parent:
            s = self._parent[id(s)]
        return s

    def _union(self, a: Scalar, b: Scalar) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra is not rb:
            if ra.is_constant and not isinstance(ra, ScalarExpr):
                ra, rb = rb, ra  # a constant stays its class's root
            self._parent[id(ra)] = rb
            self._scalars[id(ra)] = ra  # keep it alive while mapped by id

    def key(self, s: Scalar):
        """One key per class: its constant value if it has one, else the
        class's representative scalar."""
        root = self._find(s)
        return root.value if root.is_constant and not isinstance(root, ScalarExpr) else root

    def equal(self, a: Scalar, b: Scalar) -> bool:
        ra, rb = self._find(a), self._find(b)
        if ra is rb:
            return True
        return ra.is_constant and rb.is_constant and not isinstance(ra, ScalarExpr) and ra.value == rb.value

    def same(self, a: Scalar, b: Scalar) -> bool:
        """Structural equality of two extents up to the program's classes."""
        return same_scalar(a, b, self.equal)


class IdGraph:
    """Union-find of axes that ops iterate together.

    With `broadcast=True` a broadcast axis joins the axis it broadcasts to
    (used to find which operand axes a stream axis walks); without, only
    axes whose extents must be equal are joined (used to check shapes).
    Built over ops as defined, before any pass replaces operands by slices.
    """

    def __init__(self, exprs: Sequence[Expr], broadcast: bool):
        self._parent: dict[IterDomain, IterDomain] = {}
        for e in walk(exprs):
            for a, b in leaf_pairs(e):
                if not broadcast and (a.is_broadcast or b.is_broadcast):
                    continue
                self._union(a, b)

    def _find(self, d: IterDomain) -> IterDomain:
        root = d
        while self._parent.get(root, root) is not root:
            root = self._parent[root]
        while d is not root:
            d, self._parent[d] = self._parent.get(d, d), root
        return root

    def _union(self, a: IterDomain, b: IterDomain) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra is not rb:
            self._parent[ra] = rb

    def mapped(self, a: IterDomain, b: IterDomain) -> bool:
        return a is b or self._find(a) is self._find(b)

    def groups(self) -> list[list[IterDomain]]:
        by_root: dict[IterDomain, list[IterDomain]] = {}
        for d in list(self._parent):
            by_root.setdefault(self._find(d), []).append(d)
        for root, members in by_root.items():
            if root not in members:
                members.append(root)
        return list(by_root.values())
