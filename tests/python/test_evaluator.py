"""The evaluators: each op against eager torch, preallocated outputs,
bindings, error reports, and (on a GPU) streams. Every test runs on the
Python evaluator and on the C++ executor (the `evaluator` fixture)."""

from __future__ import annotations

import re

import pytest
import torch

from hostir import FusionDefinition, HostIrRuntimeError, ParallelType, ir
from hostir.container import HostIrContainer
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.streams import CudaStreams

pytestmark = pytest.mark.usefixtures("evaluator")


def _run(build, inputs, **params):
    with FusionDefinition() as fd:
        outs = build(fd)
        for o in outs:
            fd.add_output(o)
    return fd.execute(inputs, **params)


@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
def test_binary_ops(kind, device):
    x, y = torch.randn(3, 4, device=device), torch.randn(3, 4, device=device)

    def build(fd):
        a, b = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1])
        op = getattr(fd.ops, kind)
        return [op(a, b), op(a, 2.5), op(1.5, b)]

    out = _run(build, [x, y])
    fn = getattr(torch, kind)
    torch.testing.assert_close(out[0], fn(x, y))
    torch.testing.assert_close(out[1], fn(x, 2.5))
    torch.testing.assert_close(out[2], fn(torch.tensor(1.5), y))


def test_binary_type_promotion(device):
    x = torch.randint(-5, 5, (4,), dtype=torch.int32, device=device)
    y = torch.randn(4, dtype=torch.float64, device=device)

    def build(fd):
        a = fd.define_tensor([-1], dtype=torch.int32)
        b = fd.define_tensor([-1], dtype=torch.float64)
        return [fd.ops.add(a, b), fd.ops.div(a, 3), fd.ops.mul(a, 2)]

    out = _run(build, [x, y])
    for got, want in zip(out, [x + y, x / 3, x * 2]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind, fn", [("sum", torch.sum), ("max", torch.amax), ("min", torch.amin)])
def test_reductions_over_several_axes(kind, fn, device):
    x = torch.randn(3, 4, 5, device=device)

    def build(fd):
        t = fd.define_tensor([-1, -1, -1])
        return [getattr(fd.ops, kind)(t, [0, -1])]

    torch.testing.assert_close(_run(build, [x])[0], fn(x, [0, 2]))


def test_integer_sum_is_int64(device):
    x = torch.randint(0, 100, (6, 7), dtype=torch.int32, device=device)

    def build(fd):
        return [fd.ops.sum(fd.define_tensor([-1, -1], dtype=torch.int32), [1])]

    out = _run(build, [x])[0]
    assert out.dtype == torch.int64
    assert torch.equal(out, x.sum(1))


def test_ops_read_a_reduction_result(device):
    x, y = torch.randn(4, 5, device=device), torch.randn(4, device=device)

    def build(fd):
        a, b = fd.define_tensor([-1, -1]), fd.define_tensor([-1])
        s = fd.ops.sum(a, [1])
        return [fd.ops.sub(s, b)]

    torch.testing.assert_close(_run(build, [x, y])[0], x.sum(1) - y)


def test_matmul_batched_by_2d(device):
    a, b = torch.randn(2, 3, 4, device=device), torch.randn(4, 5, device=device)

    def build(fd):
        return [fd.ops.matmul(fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, -1]))]

    torch.testing.assert_close(_run(build, [a, b])[0], a @ b)


def test_linear_without_bias_on_3d_input(device):
    x, w = torch.randn(2, 3, 4, device=device), torch.randn(6, 4, device=device)

    def build(fd):
        return [fd.ops.linear(fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, -1]))]

    torch.testing.assert_close(_run(build, [x, w])[0], torch.nn.functional.linear(x, w))


def test_set_returns_a_copy(device):
    x = torch.randn(3, 3, device=device)

    def build(fd):
        return [fd.ops.set(fd.define_tensor([-1, -1]))]

    out = _run(build, [x])[0]
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, x)


def test_nan_and_inf_propagate(device):
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], device=device)

    def build(fd):
        t = fd.define_tensor([-1, -1])
        return [fd.ops.mul(t, 2.0), fd.ops.sum(t, [1])]

    out = _run(build, [x])
    torch.testing.assert_close(out[0], x * 2, equal_nan=True)
    torch.testing.assert_close(out[1], x.sum(1), equal_nan=True)


@pytest.mark.parametrize("stream", [False, True])
def test_preallocated_outputs_are_written_and_returned(stream, device):
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1])
        mm = fd.ops.matmul(a, b)
        total = fd.ops.sum(mm, [1])
        fd.add_output(mm)
        fd.add_output(total)
    if stream:
        mm.axis(0).parallelize(ParallelType.stream)
        total.axis(0).parallelize(ParallelType.stream)
    x, y = torch.randn(6, 4, device=device), torch.randn(4, 5, device=device)
    bufs = [torch.full((6, 5), 7.0, device=device), torch.full((6,), 7.0, device=device)]
    out = fd.execute([x, y], outputs=bufs)
    assert out[0] is bufs[0] and out[1] is bufs[1]
    torch.testing.assert_close(bufs[0], x @ y)
    torch.testing.assert_close(bufs[1], (x @ y).sum(1))


def _hand_built(extent_of_out=None):
    """T1 = T0 + T0 over a loop of 4; optionally T2 = ALLOCATE of extent."""
    c = HostIrContainer()
    i0 = ir.Scalar.symbolic(c)
    t0 = ir.TensorView(c, [ir.IterDomain(c, i0)], torch.float32, ir.MemoryType.global_)
    c.add_input(t0)
    return c, t0


def test_number_of_streams_is_bound_each_run(evaluator_class):
    c, t0 = _hand_built()
    n = c.named_scalar("numberOfStreams")
    buf = ir.TensorView(c, [ir.IterDomain(c, n)], torch.float32, ir.MemoryType.global_)
    c.push_back(ir.Allocate(buf, zero_init=True))
    c.add_output(buf)
    ev = evaluator_class(c)
    for n_streams in (1, 3, 8):
        (out,) = ev.run({t0: torch.randn(2)}, number_of_streams=n_streams)
        assert out.shape == (n_streams,)


def test_unbound_value_names_itself_and_the_op(evaluator_class):
    c = HostIrContainer()
    domain = [ir.IterDomain(c, ir.Scalar.symbolic(c))]
    t0 = ir.TensorView(c, domain, torch.float32, ir.MemoryType.global_)
    t1 = ir.TensorView(c, [domain[0].clone(c)], torch.float32, ir.MemoryType.global_)
    c.push_back(ir.Set(t1, t0))
    c.add_output(t1)
    with pytest.raises(HostIrRuntimeError) as err:
        evaluator_class(c).run({})
    message = str(err.value)
    assert "value T0_g_float[iS0{i0}] is not bound" in message
    assert "While executing:\nT1_g_float[iS1{i0}]\n= Set( T0_g_float[iS0{i0}], cache_op=Streaming )" in message


def test_failure_in_a_loop_reports_the_index(evaluator_class):
    c, t0 = _hand_built()
    index = ir.Scalar(label="i")
    piece = ir.TensorView(c, [], torch.float32)
    out = ir.TensorView(c, [], torch.float32)
    stop = ir.Scalar.constant(4)
    body = [ir.HirAliasSelect(piece, t0, t0.domain[0], index), ir.Set(out, piece)]
    c.push_back(ir.ForLoop(index, ir.Scalar.constant(0), stop, body))
    c.add_output(t0)
    with pytest.raises(IndexError) as err:  # torch's own error keeps its type
        evaluator_class(c).run({t0: torch.randn(2)})
    (note,) = err.value.__notes__
    assert re.search(r"(?s)^While executing:\n.*HirAliasSelect.*in loop i = 2$", note), note


def test_each_iteration_writes_a_fresh_buffer():
    """An op in a loop whose output is not a slice gets a new tensor each
    iteration, so later iterations never overwrite earlier results."""
    c, t0 = _hand_built()
    index = ir.Scalar(label="i")
    piece = ir.TensorView(c, [], torch.float32)
    doubled = ir.TensorView(c, [], torch.float32)
    body = [ir.HirAliasSelect(piece, t0, t0.domain[0], index), ir.BinaryOp(doubled, "mul", piece, ir.Scalar.constant(2))]
    c.push_back(ir.ForLoop(index, ir.Scalar.constant(0), t0.domain[0].extent, body))
    c.add_output(t0)
    ev = HostIrEvaluator(c)
    seen = []
    original = ir.BinaryOp

    from hostir.runtime import evaluator as evaluator_module

    handler = evaluator_module._HANDLERS[original]

    def spy(frame, e):
        handler(frame, e)
        seen.append(frame.get(e.out))

    evaluator_module._HANDLERS[original] = spy
    try:
        x = torch.randn(3)
        ev.run({t0: x})
    finally:
        evaluator_module._HANDLERS[original] = handler
    assert len(seen) == 3
    assert len({t.data_ptr() for t in seen}) == 3
    torch.testing.assert_close(torch.stack(seen), x * 2)


def test_allocate_keeps_a_bound_buffer_and_deallocate_unbinds(evaluator_class):
    c, t0 = _hand_built()
    buf = ir.TensorView(c, [t0.domain[0].clone(c)], torch.float32, ir.MemoryType.global_)
    c.push_back(ir.Allocate(buf))
    c.push_back(ir.Set(buf, t0))
    c.add_output(buf)
    x, given = torch.randn(5), torch.empty(5)
    (out,) = evaluator_class(c).run({t0: x, buf: given})
    assert out is given
    torch.testing.assert_close(given, x)

    c.push_back(ir.Deallocate(buf))
    with pytest.raises(HostIrRuntimeError, match="is not bound"):
        evaluator_class(c).run({t0: x})


def test_missing_handler_is_reported_when_the_evaluator_is_built():
    class Mystery(ir.Expr):
        pass

    c, _ = _hand_built()
    c.push_back(Mystery())
    with pytest.raises(NotImplementedError, match="no handler for Mystery"):
        HostIrEvaluator(c)


def test_inconsistent_bindings_are_rejected(evaluator_class):
    c, t0 = _hand_built()
    t1 = ir.TensorView(c, [ir.IterDomain(c, t0.domain[0].extent)], torch.float32, ir.MemoryType.global_)
    c.add_input(t1)
    c.add_output(t0)
    with pytest.raises(ValueError, match=r"axis 0 of T1_g_float\[iS1\{i0\}\] is 4 but its extent i0 is 3"):
        evaluator_class(c).run({t0: torch.randn(3), t1: torch.randn(4)})


# ---------------------------------------------------------------- CUDA


def _stream_program():
    """d = (a @ b) * 3 with a [chunks, m, K]: one GEMM per chunk, each on
    stream chunk % number_of_streams."""
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, -1])
        c = fd.ops.matmul(a, b)
        d = fd.ops.mul(c, 3.0)
        fd.add_output(d)
    c.axis(0).parallelize(ParallelType.stream)
    d.axis(0).parallelize(ParallelType.stream)
    return fd


def _integers(*shape):
    """Integer-valued floats: products and sums are exact in float32, so any
    difference from the reference is an ordering bug, not rounding."""
    return torch.randint(-3, 4, shape, device="cuda").float()


@pytest.mark.cuda
def test_cuda_caller_stream_is_current_again(cuda_device):
    fd = _stream_program()
    a, b = _integers(8, 16, 64), _integers(64, 32)
    before = torch.cuda.current_stream()
    (out,) = fd.execute([a, b], number_of_streams=3)
    assert torch.cuda.current_stream() == before
    assert torch.equal(out, (a @ b) * 3)


@pytest.mark.cuda
def test_cuda_uses_one_stream_per_index_value(cuda_device, evaluator):
    fd = _stream_program()
    a, b = _integers(8, 16, 64), _integers(64, 32)
    if evaluator == "cpp":
        # The C++ executor's pool is process-wide: stream indices 0..2 are
        # made once, then reused by every run.
        from hostir import _C

        fd.execute([a, b], number_of_streams=3)
        made = _C.stream_pool_size()
        fd.execute([a, b], number_of_streams=2)
        fd.execute([a, b], number_of_streams=3)
        assert _C.stream_pool_size() == made
        return
    fd.execute([a, b], number_of_streams=3)
    (program,) = fd.executor._programs.values()
    streams = program.evaluator.streams
    assert isinstance(streams, CudaStreams)
    assert len(streams) == 3
    fd.execute([a, b], number_of_streams=2)
    assert len(streams) == 3  # keys 0 and 1 reuse their streams


@pytest.mark.cuda
def test_cuda_result_is_ready_on_the_callers_stream(cuda_device):
    """Run inside `with torch.cuda.stream(s)` and read the result on `s`
    with no extra synchronization: the program joined its streams into s."""
    fd = _stream_program()
    a, b = _integers(8, 1024, 2048), _integers(2048, 2048)
    expected = (a @ b) * 3
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    copies = []
    with torch.cuda.stream(side):
        for _ in range(3):
            (out,) = fd.execute([a, b], number_of_streams=4)
            copies.append(out.clone())  # enqueued on `side`, after the join
    torch.cuda.synchronize()
    for copy in copies:
        assert torch.equal(copy, expected)


@pytest.mark.cuda
def test_cuda_worker_streams_wait_for_the_callers_work(cuda_device):
    """Inputs produced on the caller's stream right before execute are seen
    by the worker streams (they synchronize with the caller first)."""
    fd = _stream_program()
    b = _integers(1024, 1024)
    for _ in range(3):
        a = _integers(8, 512, 1024)
        torch.cuda.synchronize()
        # Keep the caller's stream busy (~50 ms) so that its write to `a` is
        # still pending when the workers start: a worker that does not wait
        # for the caller reads the old `a`.
        torch.cuda._sleep(100_000_000)
        a.mul_(2.0)
        (out,) = fd.execute([a, b], number_of_streams=4)
        assert torch.equal(out, (a @ b) * 3)
