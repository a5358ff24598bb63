"""A matmul whose product only a sum over its batch axes reads runs as that
sum (`fusion_ops.summed_products`): one batched GEMM per summed index,
accumulating into the sum's output, on both evaluators. The weights'
gradients of a mixture-of-experts layer (a product per source rank, summed
over the sources) are such sums. Each case against eager torch on random
data; the pairs that must stay two ops stay two."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostir import FusionDefinition, cpp
from hostir.lower import lower
from hostir.runtime.flat import compile_program
from hostir.runtime.fusion_ops import sum_of_products, summed_products

needs_cpp = pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}")
EVALUATORS = ["python", pytest.param("cpp", marks=needs_cpp)]


def _summed(a_rank: int, b_rank: int, dims: list[int], dtype=torch.float64):
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1] * a_rank, dtype=dtype)
        b = fd.define_tensor([-1] * b_rank, dtype=dtype)
        fd.add_output(fd.ops.sum(fd.ops.matmul(a, b), dims))
    return fd


# (a's shape, b's shape, summed dims): sources and experts as the batch axes
# of a weight's gradient, b broadcast over the sources, every batch axis.
CASES = [
    ([3, 4, 6, 5], [3, 4, 5, 7], [0]),
    ([3, 4, 6, 5], [3, 4, 5, 7], [1]),
    ([3, 4, 6, 5], [3, 4, 5, 7], [0, 1]),
    ([3, 4, 6, 5], [4, 5, 7], [0]),
    ([2, 3, 4, 6, 5], [2, 3, 4, 5, 7], [0, 2]),
]


@pytest.mark.parametrize("evaluator", EVALUATORS)
@pytest.mark.parametrize("a_shape, b_shape, dims", CASES)
def test_a_sum_over_batch_axes_of_a_product_is_torchs(a_shape, b_shape, dims, evaluator, device):
    fd = _summed(len(a_shape), len(b_shape), dims)
    a, b = (
        torch.randn(a_shape, dtype=torch.float64, device=device),
        torch.randn(b_shape, dtype=torch.float64, device=device),
    )
    (first,) = fd.execute([a, b], evaluator=evaluator)
    assert fd.last_runner.name == evaluator
    torch.testing.assert_close(first, (a @ b).sum(dims))
    # A second call's result is its own memory: the first stays as it was.
    kept = first.clone()
    a2, b2 = torch.randn_like(a), torch.randn_like(b)
    (second,) = fd.execute([a2, b2], evaluator=evaluator)
    torch.testing.assert_close(second, (a2 @ b2).sum(dims))
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


@st.composite
def products(draw):
    """Batched operands, either broadcast over any batch dim (size 1 or
    missing), and a non-empty set of the product's batch dims to sum."""
    batch = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))

    def operand(rows, cols):
        lead = draw(st.integers(0, len(batch)))
        dims = [b if draw(st.booleans()) else 1 for b in batch[len(batch) - lead :]]
        return torch.randn(*dims, rows, cols, dtype=torch.float64)

    a, b = operand(m, k), operand(k, n)
    if a.dim() == 2 and b.dim() == 2:
        a = a.unsqueeze(0).expand(batch[-1], m, k).clone()
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    return a, b, sorted(dims)


@settings(max_examples=200, deadline=None)
@given(products())
def test_sum_of_products_is_the_sum_of_the_product(case):
    """Any batch shapes, broadcast or not, any summed batch dims: torch's
    product summed."""
    a, b, dims = case
    torch.testing.assert_close(sum_of_products(a, b, dims, torch.float64), (a @ b).sum(dims))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_products_is_as_exact_as_torchs_two_steps(dtype, seed):
    """The GEMMs accumulate each source in float32 and round the running
    sum once per source (the first writes it, the rest add into it), where
    torch rounds each product and then their sum. Against the exact sum
    (float64), element by element, the walk's error is within that
    rounding's bound: the unit roundoff times the running sums'
    magnitudes, plus float32's dot-product bound for each GEMM; and on
    average it is no larger than twice torch's two steps' error."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 8, 32, 64, generator=gen).to(dtype)
    b = torch.randn(4, 8, 64, 16, generator=gen).to(dtype)
    products = a.double() @ b.double()
    exact = products.sum(0)
    walked = sum_of_products(a, b, [0], dtype)
    two_steps = (a @ b).sum(0, dtype=dtype)
    assert walked.dtype == dtype and walked.shape == exact.shape
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    running = products.cumsum(0).abs().sum(0)
    dots = 64 * 2.0**-24 * (a.double().abs() @ b.double().abs()).sum(0)
    error = (walked.double() - exact).abs()
    assert (error <= 1.01 * (unit * running + dots)).all()
    assert error.mean() <= 2 * (two_steps.double() - exact).abs().mean()
    if dtype == torch.float32:
        torch.testing.assert_close(walked, two_steps)


def test_sum_of_products_takes_torchs_two_steps_where_it_cannot_walk():
    """A summed dim that is not a batch dim, a vector operand, another dtype:
    torch's product, then its sum."""
    a, b = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(sum_of_products(a, b, [1], torch.float64), (a @ b).sum(1))
    v = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(sum_of_products(a, v, [0], torch.float64), (a @ v).sum(0))
    torch.testing.assert_close(sum_of_products(a, b, [0], torch.float32), (a @ b).sum(0, dtype=torch.float32))


def test_the_pair_runs_as_one_matmul_instruction():
    """The analysis finds the pair; the flat program has one matmul that
    stores the sum and carries its dims, no reduction, and no Deallocate of
    a product that is never made."""
    program = lower(_summed(4, 4, [0]).fusion).program
    found = summed_products(program)
    (matmul,) = [e for e in program.walk() if type(e).__name__ == "MatmulOp"]
    (total,) = [e for e in program.walk() if type(e).__name__ == "ReductionOp"]
    assert found.sums == {id(matmul): total}
    assert id(total) in found.skipped
    instrs = compile_program(program).instrs
    assert [i.op for i in instrs if i.op in ("matmul", "reduction")] == ["matmul"]
    (instr,) = [i for i in instrs if i.op == "matmul"]
    assert instr.fields["sum_dims"] == [0]
    assert [type(e).__name__ for e in program.walk()] == ["MatmulOp", "ReductionOp", "Deallocate"]
    assert not [i for i in instrs if i.op == "deallocate"]


def _not_summed(build):
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1, -1], dtype=torch.float64)
        b = fd.define_tensor([-1, -1, -1], dtype=torch.float64)
        build(fd, fd.ops.matmul(a, b))
    program = lower(fd.fusion).program
    assert summed_products(program).sums == {}
    a_in, b_in = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    product = a_in @ b_in
    expected = {
        "rows": [product.sum(1)],
        "kept": [product.sum(0), product],
        "read twice": [product.sum(0), product * 2],
    }
    return fd, a_in, b_in, expected


@pytest.mark.parametrize("evaluator", EVALUATORS)
@pytest.mark.parametrize("case", ["rows", "kept", "read twice"])
def test_a_product_something_else_needs_is_made(case, evaluator):
    """A sum over the product's rows (not a batch axis), a product that is
    also an output, a product another op reads: the matmul makes it and the
    sum sums it."""

    def build(fd, p):
        if case == "rows":
            fd.add_output(fd.ops.sum(p, [1]))
        elif case == "kept":
            fd.add_output(fd.ops.sum(p, [0]))
            fd.add_output(p)
        else:
            fd.add_output(fd.ops.sum(p, [0]))
            fd.add_output(fd.ops.mul(p, 2.0))

    fd, a, b, expected = _not_summed(build)
    results = fd.execute([a, b], evaluator=evaluator)
    assert fd.last_runner.name == evaluator
    assert len(results) == len(expected[case])
    for result, want in zip(results, expected[case]):
        torch.testing.assert_close(result, want)
