"""The alias map: chains resolve in any marking order; inputs, cycles and
conflicting marks are rejected; evaluators read and bind through it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostir import ir
from hostir.container import AliasError, HostIrContainer
from hostir.runtime.evaluator import HostIrEvaluator


def _tvs(container: HostIrContainer, n: int, shape=(-1, -1)) -> list[ir.TensorView]:
    out = []
    for _ in range(n):
        domain = [ir.IterDomain(container, ir.Scalar.symbolic(container)) for _ in shape]
        out.append(ir.TensorView(container, domain, torch.float32, ir.MemoryType.global_))
    return out


@st.composite
def chains(draw):
    """A forest of alias chains, and an order in which to mark its edges."""
    n = draw(st.integers(2, 12))
    # parent[i] < i: every node but the roots aliases an earlier node.
    parents = [None] + [draw(st.one_of(st.none(), st.integers(0, i - 1))) for i in range(1, n)]
    edges = [(p, i) for i, p in enumerate(parents) if p is not None]
    order = draw(st.permutations(edges))
    return n, parents, order


def _root(parents, i):
    while parents[i] is not None:
        i = parents[i]
    return i


@settings(max_examples=200, deadline=None)
@given(chains())
def test_chains_resolve_in_any_marking_order(data):
    n, parents, order = data
    c = HostIrContainer()
    tvs = _tvs(c, n)
    for original, alias in order:
        c.mark_alias(tvs[original], tvs[alias])
    for i in range(n):
        assert c.aliases.resolve(tvs[i]) is tvs[_root(parents, i)]
    assert len(c.aliases) == len(order)


@settings(max_examples=200, deadline=None)
@given(chains(), st.data())
def test_closing_a_chain_into_a_cycle_is_rejected(data, draw):
    n, parents, order = data
    c = HostIrContainer()
    tvs = _tvs(c, n)
    for original, alias in order:
        c.mark_alias(tvs[original], tvs[alias])
    # Mark a root as an alias of one of its own descendants (or of itself).
    roots = [i for i in range(n) if parents[i] is None]
    root = draw.draw(st.sampled_from(roots))
    descendants = [i for i in range(n) if _root(parents, i) == root]
    target = draw.draw(st.sampled_from(descendants))
    before = c.aliases.items()
    with pytest.raises(AliasError, match="cycle|itself"):
        c.mark_alias(tvs[target], tvs[root])
    assert c.aliases.items() == before


@settings(max_examples=100, deadline=None)
@given(chains(), st.data())
def test_an_alias_has_one_original(data, draw):
    n, parents, order = data
    if not order:
        return
    c = HostIrContainer()
    tvs = _tvs(c, n + 1)
    for original, alias in order:
        c.mark_alias(tvs[original], tvs[alias])
    original, alias = draw.draw(st.sampled_from(order))
    c.mark_alias(tvs[original], tvs[alias])  # the same edge again is fine
    with pytest.raises(AliasError, match="already an alias"):
        c.mark_alias(tvs[n], tvs[alias])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.booleans())
def test_inputs_cannot_be_aliased(n, mark_first):
    c = HostIrContainer()
    *others, tv = _tvs(c, n + 1)
    original = others[-1] if others else _tvs(c, 1)[0]
    if mark_first:
        c.mark_alias(original, tv)
        with pytest.raises(AliasError, match="Inputs cannot be aliased"):
            c.add_input(tv)
    else:
        c.add_input(tv)
        with pytest.raises(AliasError, match="Inputs cannot be aliased"):
            c.mark_alias(original, tv)


def test_evaluator_rejects_an_aliased_input():
    c = HostIrContainer()
    t0, t1 = _tvs(c, 2)
    c.mark_alias(t0, t1)
    c.inputs.append(t1)  # bypassing add_input's check
    with pytest.raises(AliasError, match="Inputs cannot be aliased"):
        HostIrEvaluator(c)


def test_alias_needs_matching_dtype_and_rank():
    c = HostIrContainer()
    (a,) = _tvs(c, 1)
    (b,) = _tvs(c, 1, shape=(-1,))
    with pytest.raises(AliasError, match="dtype and rank must match"):
        c.mark_alias(a, b)


def test_only_tensors_alias():
    c = HostIrContainer()
    (a,) = _tvs(c, 1)
    with pytest.raises(TypeError, match="only TensorViews"):
        c.mark_alias(a, ir.Scalar.constant(3))


def _set_and_get(reverse: bool):
    """tv1 = set(tv0); tv2 aliases tv1; tv3 = set(tv2); tv4 aliases tv3."""
    c = HostIrContainer()
    tv0, tv1, tv2, tv3, tv4 = _tvs(c, 5)
    c.add_input(tv0)
    c.push_back(ir.Set(tv1, tv0))
    c.push_back(ir.Set(tv3, tv2))
    c.add_output(tv4)
    marks = [(tv1, tv2), (tv3, tv4)]
    for original, alias in reversed(marks) if reverse else marks:
        c.mark_alias(original, alias)
    return c, tv0, tv4


@pytest.mark.parametrize("reverse", [False, True])
def test_reading_and_writing_through_aliases(reverse, device):
    c, tv0, _ = _set_and_get(reverse)
    c.verify()
    x = torch.randn(4, 6, device=device)
    (out,) = HostIrEvaluator(c, device=device).run({tv0: x})
    torch.testing.assert_close(out, x)


def test_binding_an_alias_binds_its_original(device):
    """A preallocated output bound to an alias is written by the op that
    writes the original."""
    c, tv0, tv4 = _set_and_get(reverse=False)
    x = torch.randn(4, 6, device=device)
    buffer = torch.empty(4, 6, device=device)
    (out,) = HostIrEvaluator(c, device=device).run({tv0: x, tv4: buffer})
    assert out is buffer
    torch.testing.assert_close(buffer, x)


def test_dump_ends_with_the_aliases_block():
    c, _, _ = _set_and_get(reverse=False)
    text = str(c)
    body, aliases = text.split("} // %HostIrContainer\n")
    assert aliases == (
        "Aliases:{\n"
        "  T2_g_float[iS4{i4}, iS5{i5}] -> T1_g_float[iS2{i2}, iS3{i3}]\n"
        "  T4_g_float[iS8{i8}, iS9{i9}] -> T3_g_float[iS6{i6}, iS7{i7}]\n"
        "}\n"
    )


def test_dump_without_aliases_has_no_block():
    c = HostIrContainer()
    (t0,) = _tvs(c, 1)
    c.add_input(t0)
    assert "Aliases" not in str(c)
