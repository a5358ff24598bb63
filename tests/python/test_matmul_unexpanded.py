"""A matmul whose one operand is broadcast over leading batch dims the other
holds (the experts' weights beside tokens from every source rank) runs as a
matmul per leading index, on both evaluators (`fusion_ops.matmul_unexpanded`,
the C++ `matmulUnexpanded`): torch's matmul would copy the shared operand
once per index. Against eager torch on random data, and the copy is never
made."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostir import FusionDefinition, cpp
from hostir.runtime import fusion_ops
from hostir.runtime.fusion_ops import matmul_unexpanded

needs_cpp = pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}")
EVALUATORS = ["python", pytest.param("cpp", marks=needs_cpp)]


def largest_allocation(call) -> int:
    """The most bytes one allocation took while `call()` ran (the allocator's
    own record: an op's internal copies included, which no dispatch mode
    sees below a composite op called from C++)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


@st.composite
def products(draw):
    """Operands with batch dims, one of them broadcast (size 1 or missing)
    over some leading dims the other holds, or neither."""
    batch = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    lead = draw(st.integers(0, len(batch)))
    shared_is_b = draw(st.booleans())
    rest = batch[lead:]
    full = [*batch, m, k] if shared_is_b else [*batch, k, n]
    small = [1] * lead + rest if draw(st.booleans()) else rest
    small = [*small, k, n] if shared_is_b else [*small, m, k]
    x, y = torch.randn(full, dtype=torch.float64), torch.randn(small, dtype=torch.float64)
    return (x, y) if shared_is_b else (y, x)


@settings(max_examples=200, deadline=None)
@given(products(), st.booleans())
def test_matmul_unexpanded_is_torchs_matmul(case, into):
    a, b = case
    want = torch.matmul(a, b)
    with pytest.MonkeyPatch.context() as patch:
        # Walk every shared operand, however small (these shapes are).
        patch.setattr(fusion_ops, "UNEXPANDED_MIN", 0)
        if into:
            out = torch.full_like(want, float("nan"))
            got = matmul_unexpanded(a, b, out)
            assert got is out
        else:
            got = matmul_unexpanded(a, b)
    torch.testing.assert_close(got, want)


# Sources 4, experts 4, rows 8, K = N = 256: the weights [4, 256, 256] are
# 2**18 elements, enough to walk; torch's matmul would copy them 4 times.
S, E, M, K, N = 4, 4, 8, 256, 256


@pytest.mark.parametrize("evaluator", EVALUATORS)
@pytest.mark.parametrize("weight_first", [False, True])
def test_a_weight_shared_by_the_sources_is_never_copied(weight_first, evaluator):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1], dtype=torch.float64)
        w = fd.define_tensor([-1, -1, -1], dtype=torch.float64)
        fd.add_output(fd.ops.matmul(w, x) if weight_first else fd.ops.matmul(x, w))
    if weight_first:
        x_in, w_in = torch.randn(S, E, K, M, dtype=torch.float64), torch.randn(E, N, K, dtype=torch.float64)
    else:
        x_in, w_in = torch.randn(S, E, M, K, dtype=torch.float64), torch.randn(E, K, N, dtype=torch.float64)

    def eager():
        return w_in @ x_in if weight_first else x_in @ w_in

    want = eager()
    (got,) = fd.execute([x_in, w_in], evaluator=evaluator)
    assert fd.last_runner.name == evaluator
    torch.testing.assert_close(got, want)
    # torch's matmul here allocates S copies of the weight at once.
    assert largest_allocation(eager) >= S * w_in.nbytes
    largest = largest_allocation(lambda: fd.execute([x_in, w_in], evaluator=evaluator))
    assert largest < 2 * w_in.nbytes, f"an allocation of {largest} bytes: the weight copied per source"


def test_operands_that_want_gradients_take_torchs_recorded_ops():
    """With grad mode on and an operand that requires grad (out= ops refuse
    to be recorded), both walks give torch's result and its gradients."""
    x = torch.randn(S, E, M, K, dtype=torch.float64, requires_grad=True)
    w = torch.randn(E, K, N, dtype=torch.float64, requires_grad=True)
    g = torch.randn(S, E, M, N, dtype=torch.float64)
    got = torch.autograd.grad(matmul_unexpanded(x, w), (x, w), g)
    want = torch.autograd.grad(torch.matmul(x, w), (x, w), g)
    torch.testing.assert_close(got, want)
    y = torch.randn(S, E, K, N, dtype=torch.float64, requires_grad=True)
    h = torch.randn(E, M, N, dtype=torch.float64)
    got = torch.autograd.grad(fusion_ops.sum_of_products(x, y, [0], torch.float64), (x, y), h)
    want = torch.autograd.grad(torch.matmul(x, y).sum(0), (x, y), h)
    torch.testing.assert_close(got, want)
