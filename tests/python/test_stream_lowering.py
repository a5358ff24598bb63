"""The stream-parallelization passes: golden dumps paired with numeric checks.

Each case builds a program with the public API, runs `parallelize_streams`
alone on it (as nvFuser's pass tests do on a hand-built container) and
compares the dump (loops marked to run on worker streams) with
tests/python/golden/<case>.hir; then `assign_streams` after it, whose dump
(the caller/worker pattern) is tests/python/golden/assign_<case>.hir; and
runs the whole pipeline on random inputs against eager torch for several
numbers of streams. The reference pull request's three programs, after
both passes, must print its dumps up to value numbering.
"""

from __future__ import annotations

import pytest
import torch

from conftest import GOLDEN, check_golden, renumber
from hostir import FusionDefinition, LoweringError, ParallelType
from hostir.lower import run_passes
from hostir.lower.assign_streams import assign_streams
from hostir.lower.build_host_program import build_host_program
from hostir.lower.parallelize_streams import parallelize_streams

STREAM = ParallelType.stream


def _define(build):
    """A FusionDefinition from `build(fd) -> (outputs, stream axes)`."""
    with FusionDefinition() as fd:
        outputs, stream_axes = build(fd)
        for out in outputs:
            fd.add_output(out)
    for tv, axis in stream_axes:
        tv.axis(axis).parallelize(STREAM)
    return fd


def stream_pass_program(fd):
    """The program after `parallelize_streams` alone."""
    return run_passes(build_host_program(fd.fusion), [parallelize_streams])


def assigned_program(fd):
    """The program after `parallelize_streams` and `assign_streams`."""
    return run_passes(build_host_program(fd.fusion), [parallelize_streams, assign_streams])


def stream_pass_dump(fd) -> str:
    return str(stream_pass_program(fd))


def single_set(fd):
    x = fd.define_tensor([-1, -1])
    y = fd.ops.set(x)
    return [y], [(y, 0)]


def two_sets_merged(fd):
    x = fd.define_tensor([-1, -1])
    y = fd.ops.set(x)
    z = fd.ops.set(y)
    return [z], [(y, 0), (z, 0)]


def three_sets_split(fd):
    x = fd.define_tensor([-1, -1])
    a = fd.ops.set(x)
    b = fd.ops.set(a)
    c = fd.ops.set(b)
    return [c], [(a, 0), (c, 0)]


def binary_add(fd):
    x = fd.define_tensor([-1, -1])
    y = fd.define_tensor([-1, -1])
    z = fd.ops.add(x, y)
    return [z], [(z, 0)]


def binary_broadcast(fd):
    x = fd.define_tensor([-1, -1])
    row = fd.define_tensor([1, -1])
    z = fd.ops.mul(x, row)
    return [z], [(z, 0)]


def reduction_kept_axis(fd):
    x = fd.define_tensor([-1, -1, -1])
    s = fd.ops.sum(x, [2])
    return [s], [(s, 0)]


def max_on_inner_kept_axis(fd):
    x = fd.define_tensor([-1, -1, -1])
    m = fd.ops.max(x, [0])
    return [m], [(m, 2)]


def matmul_m(fd):
    a = fd.define_tensor([-1, -1])
    b = fd.define_tensor([-1, -1])
    c = fd.ops.matmul(a, b)
    return [c], [(c, 0)]


def matmul_n(fd):
    a = fd.define_tensor([-1, -1])
    b = fd.define_tensor([-1, -1])
    c = fd.ops.matmul(a, b)
    return [c], [(c, 1)]


def matmul_batch(fd):
    a = fd.define_tensor([-1, -1, -1])
    b = fd.define_tensor([-1, -1, -1])
    c = fd.ops.matmul(a, b)
    return [c], [(c, 0)]


def batched_matmul_m(fd):
    a = fd.define_tensor([-1, -1, -1])
    b = fd.define_tensor([-1, -1])
    c = fd.ops.matmul(a, b)
    return [c], [(c, 1)]


def linear_m_bias(fd):
    x = fd.define_tensor([-1, -1])
    w = fd.define_tensor([-1, -1])
    bias = fd.define_tensor([-1])
    y = fd.ops.linear(x, w, bias)
    return [y], [(y, 0)]


def linear_n_bias(fd):
    x = fd.define_tensor([-1, -1])
    w = fd.define_tensor([-1, -1])
    bias = fd.define_tensor([-1])
    y = fd.ops.linear(x, w, bias)
    return [y], [(y, 1)]


def set_not_outermost(fd):
    x = fd.define_tensor([-1, -1])
    y = fd.ops.set(x)
    return [y], [(y, 1)]


def chain_then_matmul(fd):
    """An elementwise op and a matmul on the same stream axis: one loop."""
    a = fd.define_tensor([-1, -1])
    b = fd.define_tensor([-1, -1])
    scaled = fd.ops.mul(a, 0.5)
    c = fd.ops.matmul(scaled, b)
    return [c], [(scaled, 0), (c, 0)]


# (builder, input shapes, eager reference)
CASES = {
    "single_set": (single_set, [(6, 5)], lambda x: [x.clone()]),
    "two_sets_merged": (two_sets_merged, [(6, 5)], lambda x: [x.clone()]),
    "three_sets_split": (three_sets_split, [(6, 5)], lambda x: [x.clone()]),
    "binary_add": (binary_add, [(6, 5), (6, 5)], lambda x, y: [x + y]),
    "binary_broadcast": (binary_broadcast, [(6, 5), (1, 5)], lambda x, r: [x * r]),
    "reduction_kept_axis": (reduction_kept_axis, [(4, 3, 5)], lambda x: [x.sum(2)]),
    "max_on_inner_kept_axis": (max_on_inner_kept_axis, [(4, 3, 5)], lambda x: [x.amax(0)]),
    "matmul_m": (matmul_m, [(6, 4), (4, 7)], lambda a, b: [a @ b]),
    "matmul_n": (matmul_n, [(6, 4), (4, 7)], lambda a, b: [a @ b]),
    "matmul_batch": (matmul_batch, [(3, 6, 4), (3, 4, 7)], lambda a, b: [a @ b]),
    "batched_matmul_m": (batched_matmul_m, [(3, 6, 4), (4, 7)], lambda a, b: [a @ b]),
    "linear_m_bias": (
        linear_m_bias,
        [(6, 4), (7, 4), (7,)],
        lambda x, w, b: [torch.nn.functional.linear(x, w, b)],
    ),
    "linear_n_bias": (
        linear_n_bias,
        [(6, 4), (7, 4), (7,)],
        lambda x, w, b: [torch.nn.functional.linear(x, w, b)],
    ),
    "set_not_outermost": (set_not_outermost, [(6, 5)], lambda x: [x.clone()]),
    "chain_then_matmul": (chain_then_matmul, [(6, 4), (4, 7)], lambda a, b: [(a * 0.5) @ b]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_dump(case):
    build, _, _ = CASES[case]
    check_golden(case, stream_pass_program(_define(build)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_assigned_golden_dump(case):
    build, _, _ = CASES[case]
    check_golden(f"assign_{case}", assigned_program(_define(build)))


@pytest.mark.parametrize(
    "case", ["single_set", "two_sets_merged", "three_sets_split"]
)
def test_reference_pr_dump(case):
    """The reference pull request's dumps, up to the numbering of values."""
    build, _, _ = CASES[case]
    expected = (GOLDEN / f"reference_{case}.hir").read_text()
    assert renumber(str(assigned_program(_define(build)))) == renumber(expected)


@pytest.mark.parametrize("number_of_streams", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case, number_of_streams, device):
    build, shapes, reference = CASES[case]
    fd = _define(build)
    inputs = [torch.randn(s, device=device) for s in shapes]
    outputs = fd.execute(inputs, number_of_streams=number_of_streams)
    expected = reference(*inputs)
    assert len(outputs) == len(expected)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref)


def test_merged_program_has_one_loop():
    text = _define(two_sets_merged).host_ir()
    assert text.count("FOR StreamIdx") == 1


def test_non_stream_op_between_splits_loops():
    text = stream_pass_dump(_define(three_sets_split))
    assert text.count("FOR StreamIdx") == 2


def test_unmapped_stream_axes_split_loops():
    """Two adjacent stream ops on axes that do not map get two loops."""

    def build(fd):
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        z = fd.ops.set(y)
        return [z], [(y, 0), (z, 1)]

    fd = _define(build)
    assert fd.host_ir().count("FOR StreamIdx") == 2
    x = torch.randn(3, 4)
    (out,) = fd.execute([x])
    torch.testing.assert_close(out, x)


def test_same_tensor_on_both_sides_is_sliced_once():
    def build(fd):
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(x, x)
        return [y], [(y, 0)]

    fd = _define(build)
    assert fd.host_ir().count("HirAliasSelect( T0_") == 1
    x = torch.randn(5, 3)
    torch.testing.assert_close(fd.execute([x])[0], x * x)


def test_stream_on_reduction_axis_is_an_error():
    def build(fd):
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, [1])
        return [s], [(s, 1)]

    fd = _define(build)
    with pytest.raises(LoweringError, match=r"stream axis rStreamIdx\d+\{i\d+\} of T1.* is a reduction axis"):
        fd.execute([torch.randn(3, 4)])


def test_stream_on_matmul_k_is_an_error():
    def build(fd):
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        c = fd.ops.matmul(a, b)
        return [c], [(c, 2)]

    with pytest.raises(LoweringError, match="is a reduction axis"):
        _define(build).host_ir()


def test_two_stream_axes_on_one_tensor_is_an_error():
    def build(fd):
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        return [y], [(y, 0), (y, 1)]

    with pytest.raises(LoweringError, match="has 2 stream axes .* at most one"):
        _define(build).execute([torch.randn(2, 2)])


def test_stream_axis_on_an_input_is_propagated_to_its_consumer(device):
    def build(fd):
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(x, 3.0)
        return [y], [(x, 0)]

    fd = _define(build)
    text = fd.host_ir()
    assert text.count("FOR StreamIdx in iStreamIdx") == 1, text
    assert "-> (T1_g_float[iStreamIdx" in text, text
    x = torch.randn(5, 4, device=device)
    torch.testing.assert_close(fd.execute([x])[0], x * 3.0)


def test_error_names_the_pass():
    def build(fd):
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, [0])
        return [s], [(s, 0)]

    with pytest.raises(LoweringError, match="^lowering pass parallelize_streams: "):
        _define(build).host_ir()


def test_zero_chunks_run_no_iteration(device):
    fd = _define(single_set)
    x = torch.randn(0, 5, device=device)
    (out,) = fd.execute([x])
    assert out.shape == (0, 5)


def test_one_program_serves_every_shape(device):
    fd = _define(reduction_kept_axis)
    for shape in [(4, 3, 5), (7, 2, 1), (1, 9, 3)]:
        x = torch.randn(shape, device=device)
        torch.testing.assert_close(fd.execute([x])[0], x.sum(2))
    assert fd.executor.lowerings == 1
