"""The deallocation pass: golden dumps of the pass, where each buffer is
freed (after its last use, after a stream loop's join, after the Wait of a
collective that uses it), and checks that the memory is really released
while the program still computes what eager torch computes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import check_golden
from hostir import DeviceMesh, FusionDefinition, ParallelType, ir
from hostir.runtime import evaluator
from hostir.lower import lower, run_passes
from hostir.lower.assign_streams import assign_streams
from hostir.lower.build_host_program import build_host_program
from hostir.lower.insert_deallocations import insert_deallocations
from hostir.lower.parallelize_streams import parallelize_streams

STREAM = ParallelType.stream


def chain():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.mul(x, 2.0)
        b = fd.ops.add(a, x)
        c = fd.ops.sub(b, a)
        fd.add_output(fd.ops.sum(c, [1]))
    return fd, lambda x: [((x * 2.0 + x) - x * 2.0).sum(1)]


def stream_loop_then_serial():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        z = fd.ops.mul(y, 3.0)
        fd.add_output(fd.ops.sum(z, [0]))
    y.axis(0).parallelize(STREAM)
    z.axis(0).parallelize(STREAM)
    return fd, lambda x: [(x * 3.0).sum(0)]


def _pass_dump(fd) -> str:
    return str(run_passes(build_host_program(fd.fusion), [parallelize_streams, assign_streams, insert_deallocations]))


@pytest.mark.parametrize("case", [chain, stream_loop_then_serial])
def test_golden_dump(case):
    fd, _ = case()
    check_golden(f"deallocate_{case.__name__}", _pass_dump(fd))


def test_buffer_of_a_stream_loop_is_freed_after_the_loop():
    fd, _ = stream_loop_then_serial()
    container = lower(fd.fusion).program
    loop_at = next(i for i, e in enumerate(container.exprs) if isinstance(e, ir.ForLoop))
    frees = {e.buffer.name: i for i, e in enumerate(container.exprs) if isinstance(e, ir.Deallocate)}
    # T1 (y) and T2 (z) are written in the loop; z is read after it.
    assert frees[1] == loop_at + 1
    assert frees[2] > loop_at + 1
    assert not any(isinstance(e, ir.Deallocate) for e in ir.walk(container.exprs[loop_at].body))


def test_buffer_bound_in_a_loop_body_is_freed_in_the_body():
    container = ir_loop_with_local_buffer()
    (loop,) = [e for e in container.exprs if isinstance(e, ir.ForLoop)]
    body = [type(e).__name__ for e in loop.body]
    assert body == ["Set", "BinaryOp", "Deallocate"], body
    assert loop.body[2].buffer is loop.body[0].out


def ir_loop_with_local_buffer():
    """A loop whose body binds a fresh T2 = Set(T0) and reads it once."""
    from hostir.container import HostIrContainer

    c = HostIrContainer()
    n = ir.Scalar.symbolic(c)
    t0 = ir.TensorView(c, [ir.IterDomain(c, n)], torch.float32, ir.MemoryType.global_)
    t1 = ir.TensorView(c, [ir.IterDomain(c, n)], torch.float32, ir.MemoryType.global_)
    t2 = ir.TensorView(c, [ir.IterDomain(c, n)], torch.float32)
    c.add_input(t0)
    c.add_input(t1)
    i = ir.Scalar(label="i")
    body = [ir.Set(t2, t0), ir.BinaryOp(t1, "add", t1, t2)]
    c.push_back(ir.ForLoop(i, ir.Scalar.constant(0), ir.Scalar.constant(3), body))
    c.add_output(t1)
    c.verify()
    return insert_deallocations(c)


def test_deallocate_of_a_collective_input_comes_after_its_wait():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        a = fd.ops.mul(x, 2.0)
        y = fd.ops.set(a)
        fd.add_output(y)
    for tv in (x, a, y):
        tv.set_device_mesh(DeviceMesh([0, 1]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    a.axis(0).parallelize(ParallelType.mesh_x)
    text = str(lower(fd.fusion, rank=0).program)
    check_golden("deallocate_after_wait", text)
    lines = [line.strip() for line in text.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("Wait Communication"))
    free = next(i for i, line in enumerate(lines) if line.startswith("Deallocate"))
    assert free > wait and lines[free + 1].startswith("T1_")


def _track_buffers(monkeypatch):
    """Weak references to the storage of every buffer the program binds
    fresh, and a check, right after each Deallocate, that its storage is
    gone (nothing else, not even a slice of it, keeps it alive)."""
    handlers = evaluator._HANDLERS
    storages: dict = {}
    freed: list = []

    def remember(ev, tvs):
        for tv in tvs:
            value = ev.get(tv, None)
            if isinstance(value, torch.Tensor) and tv not in storages:
                storages[tv] = weakref.ref(value.untyped_storage())

    def wrap(op, after):
        original = handlers[op]

        def handler(ev, e):
            before = {tv: ev.get(tv, None) is not None for tv in ir.defined_tvs(e)}
            original(ev, e)
            after(ev, e, [tv for tv, was in before.items() if not was])

        monkeypatch.setitem(handlers, op, handler)

    for op in (ir.Allocate, ir.Set, ir.BinaryOp, ir.ReductionOp, ir.MatmulOp, ir.LinearOp):
        wrap(op, lambda ev, e, fresh: remember(ev, fresh))

    def check_freed(ev, e, fresh):
        gc.collect()
        ref = storages.get(e.buffer)
        assert ref is not None, f"T{e.buffer.name} was freed but never bound fresh"
        assert ref() is None, f"T{e.buffer.name}'s memory is still alive after its Deallocate"
        freed.append(e.buffer.name)

    wrap(ir.Deallocate, check_freed)
    return freed


@pytest.mark.parametrize("number_of_streams", [1, 2])
@pytest.mark.parametrize("case", [chain, stream_loop_then_serial])
def test_memory_is_released_and_results_stay_right(case, number_of_streams, monkeypatch):
    # The Python evaluator's handlers are what the tracking wraps; the dry
    # run's rehearsal on meta tensors (HOSTIR_FAKE=auto) is not the run
    # whose memory this checks.
    monkeypatch.setenv("HOSTIR_EVALUATOR", "python")
    monkeypatch.setenv("HOSTIR_FAKE", "0")
    fd, reference = case()
    freed = _track_buffers(monkeypatch)
    x = torch.randn(6, 5)
    (out,) = fd.execute([x], number_of_streams=number_of_streams)
    torch.testing.assert_close(out, reference(x)[0])
    intermediates = len(fd.fusion.exprs) - len(fd.fusion.outputs)
    assert len(freed) == intermediates, freed


def test_buffer_used_on_workers_is_freed_after_a_separate_join_loop():
    """nvFuser's later form joins the workers in a loop of its own after the
    work loop: the free waits for that join."""
    from hostir.container import HostIrContainer

    c = HostIrContainer()
    n = ir.Scalar.symbolic(c)
    t0 = ir.TensorView(c, [ir.IterDomain(c, n)], torch.float32, ir.MemoryType.global_)
    t1 = ir.TensorView(c, [ir.IterDomain(c, n)], torch.float32, ir.MemoryType.global_)
    out = ir.TensorView(c, [ir.IterDomain(c, n)], torch.float32, ir.MemoryType.global_)
    c.add_input(t0)
    i = ir.Scalar(label="i")
    caller = ir.Stream(c)
    worker = ir.Stream(c, index=i)
    work = ir.ForLoop(i, ir.Scalar.constant(0), ir.Scalar.constant(2), [ir.SetCurrentStream(worker), ir.Set(t1, t0)])
    join = ir.ForLoop(i, ir.Scalar.constant(0), ir.Scalar.constant(2), [ir.Synchronize(worker)])
    for e in (ir.GetCurrentStream(caller), ir.Allocate(t1), work, ir.SetCurrentStream(caller), join, ir.Set(out, t0)):
        c.push_back(e)
    c.add_output(out)
    names = [type(e).__name__ for e in insert_deallocations(c).exprs]
    assert names == [
        "GetCurrentStream", "Allocate", "ForLoop", "SetCurrentStream", "ForLoop", "Deallocate", "Set"
    ], names


@pytest.mark.cuda
@pytest.mark.parametrize("evaluator", ["python", "cpp"])
def test_a_stream_loops_slices_do_not_hold_its_buffer_past_its_deallocate(cuda_device, evaluator):
    # T1 (y) is written through per-iteration slices and freed after the
    # loop; the last iteration's slice must not keep its memory until the
    # run's end, under the big product made after the loop.
    from hostir import cpp

    if evaluator == "cpp" and not cpp.available():
        pytest.skip("the C++ executor is not built")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        big = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        z = fd.ops.mul(y, 3.0)
        fd.add_output(fd.ops.sum(z, [0]))
        fd.add_output(fd.ops.mul(big, 2.0))
    y.axis(0).parallelize(STREAM)
    z.axis(0).parallelize(STREAM)
    x = torch.randn(64, 1024, device=cuda_device)
    big = torch.randn(1024, 1024, device=cuda_device)
    fd.execute([x, big], evaluator=evaluator)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s, doubled = fd.execute([x, big], evaluator=evaluator)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    torch.testing.assert_close(s, (x * 3.0).sum(0))
    torch.testing.assert_close(doubled, big * 2.0)
    slab, product = x.numel() * 4, big.numel() * 4
    # The loop's two slabs, or the product and the sum: never a slab beside the product.
    assert peak < product + slab, (peak, product, slab)
