"""Properties of the stream passes on random programs: every lowered program
verifies, has the loop structure the rules promise, and computes what eager
torch computes; `assign_streams` adds stream ops and moves nothing else,
in either form."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostir import FusionDefinition, ParallelType, ir
from hostir.analysis.races import check_races
from hostir.lower import lower
from hostir.runtime.evaluator import HostIrEvaluator

# Elementwise steps on a [rows, cols] tensor: (name, hostir op, torch op).
STEPS = {
    "set": (lambda fd, t, w: fd.ops.set(t), lambda t, w: t.clone()),
    "add_w": (lambda fd, t, w: fd.ops.add(t, w), lambda t, w: t + w),
    "mul_c": (lambda fd, t, w: fd.ops.mul(t, 1.5), lambda t, w: t * 1.5),
    "rsub_c": (lambda fd, t, w: fd.ops.sub(0.25, t), lambda t, w: 0.25 - t),
    "div_w": (lambda fd, t, w: fd.ops.div(t, w), lambda t, w: t / w),
}


@st.composite
def programs(draw):
    steps = draw(st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=6))
    # For each step: None (not stream-parallel), or the stream axis 0 or 1.
    axes = draw(st.lists(st.sampled_from([None, 0, 1]), min_size=len(steps), max_size=len(steps)))
    reduce = draw(st.sampled_from([None, 0, 1]))
    reduce_stream = draw(st.booleans())
    rows, cols = draw(st.integers(0, 5)), draw(st.integers(1, 5))
    streams = draw(st.integers(1, 4))
    return steps, axes, reduce, reduce_stream, (rows, cols), streams


def _build(steps, axes, reduce, reduce_stream):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1, -1])
        t, tvs = x, []
        for name in steps:
            t = STEPS[name][0](fd, t, w)
            tvs.append(t)
        outputs = [t]
        if reduce is not None:
            outputs.append(fd.ops.sum(t, [reduce]))
        for o in outputs:
            fd.add_output(o)
    for tv, axis in zip(tvs, axes):
        if axis is not None:
            tv.axis(axis).parallelize(ParallelType.stream)
    if reduce is not None and reduce_stream:
        outputs[1].axis(1 - reduce).parallelize(ParallelType.stream)
    return fd


def _propagated(steps, axes, reduce, reduce_stream):
    """The stream axis of every op's output after `propagate_stream_axes`:
    an unscheduled output takes its producer's stream axis (unless the sum
    reduces that axis), an unscheduled producer its consumer's; the inputs
    take none. The elementwise steps map axis k to axis k, the sum keeps
    the position of every axis."""
    marks = list(axes)
    scheduled = [a is not None for a in axes]
    if reduce is not None:
        marks.append(1 - reduce if reduce_stream else None)
        scheduled.append(reduce_stream)
    n = len(marks)
    changed = True
    while changed:
        changed = False
        for i in range(1, n):
            if not scheduled[i] and marks[i] is None and marks[i - 1] is not None:
                if i == len(steps) and marks[i - 1] == reduce:
                    continue
                marks[i] = marks[i - 1]
                changed = True
        for i in reversed(range(1, n)):
            if marks[i] is not None and not scheduled[i - 1] and marks[i - 1] is None:
                marks[i - 1] = marks[i]
                changed = True
    return marks


def _expected_loops(steps, axes, reduce, reduce_stream):
    """Consecutive stream ops share a loop iff their stream axes map."""
    loops, prev = 0, None
    for m in _propagated(steps, axes, reduce, reduce_stream):
        if m is not None and m != prev:
            loops += 1
        prev = m
    return loops


def _uses(e) -> set:
    if isinstance(e, ir.ForLoop):
        return set().union(*(_uses(b) for b in e.body)) if e.body else set()
    sources = [e.input] if isinstance(e, ir.HirAliasSelect) else []
    return {v for v in e.inputs() + e.outputs() + sources if isinstance(v, ir.TensorView)}


def _check_deallocations(container) -> None:
    """Every intermediate top-level buffer is freed once, at the top level
    (after the loop that uses it, never inside it), and nothing uses it
    after; inputs and outputs are never freed."""
    exprs = container.exprs
    keep = set(container.inputs + container.outputs)
    sliced = {}
    for e in ir.walk(exprs):
        if isinstance(e, ir.HirAliasSelect):
            sliced[e.out] = e.input
    assert not any(isinstance(b, ir.Deallocate) for e in exprs if isinstance(e, ir.ForLoop) for b in ir.walk(e.body))
    freed = [e.buffer for e in exprs if isinstance(e, ir.Deallocate)]
    assert len(freed) == len(set(freed))
    assert not keep & set(freed)
    defined = {t for e in exprs if not isinstance(e, ir.ForLoop) for t in ir.defined_tvs(e)}
    assert defined - keep == set(freed)
    for i, e in enumerate(exprs):
        if not isinstance(e, ir.Deallocate):
            continue
        for later in exprs[i + 1 :]:
            used = {sliced.get(v, v) for v in _uses(later)}
            assert e.buffer not in used, f"T{e.buffer.name} is used after it is freed"


@settings(max_examples=60, deadline=None)
@given(programs())
def test_random_programs_lower_and_match_eager(program):
    steps, axes, reduce, reduce_stream, shape, streams = program
    fd = _build(steps, axes, reduce, reduce_stream)
    container = lower(fd.fusion).program

    loops = [e for e in container.exprs if isinstance(e, ir.ForLoop)]
    assert len(loops) == _expected_loops(steps, axes, reduce, reduce_stream)
    allocated: set = set()
    defined: set = set(container.inputs)
    for e in container.exprs:
        if isinstance(e, ir.Allocate):
            allocated.add(e.buffer)
        defined.update(ir.defined_tvs(e))
        if not isinstance(e, ir.ForLoop):
            continue
        body = e.body
        assert [type(b) for b in body[:3]] == [ir.GetCurrentStream, ir.SetCurrentStream, ir.Synchronize]
        assert [type(b) for b in body[-2:]] == [ir.SetCurrentStream, ir.Synchronize]
        caller, worker = body[0].stream, body[1].stream
        assert body[2].stream is caller and body[-2].stream is caller
        assert body[-1].stream is worker and worker.index is not None
        # Slices are cut from buffers defined before the loop, and every op
        # in the body writes a slice of a buffer allocated before the loop.
        source = {}
        for inner in body:
            if isinstance(inner, ir.HirAliasSelect):
                assert inner.input in defined
                source[inner.out] = inner.input
            elif isinstance(inner, ir.FUSION_OPS):
                assert source[inner.out] in allocated

    _check_deallocations(container)

    x = torch.randn(shape)
    w = torch.rand(shape) + 0.5
    t = x
    for name in steps:
        t = STEPS[name][1](t, w)
    expected = [t] if reduce is None else [t, t.sum(reduce)]
    outputs = fd.execute([x, w], number_of_streams=streams)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want)


def _without_stream_ops(exprs) -> list:
    """`exprs` without stream switches and waits, and without the loops
    left empty by that (the pipelined form's loop of waits)."""
    kept = []
    for e in exprs:
        if isinstance(e, (ir.GetCurrentStream, ir.SetCurrentStream, ir.Synchronize)):
            continue
        if isinstance(e, ir.ForLoop):
            body = _without_stream_ops(e.body)
            if not body:
                continue
            e = e.replace(body=body)
        kept.append(e)
    return kept


def _unmarked(exprs) -> list:
    return [
        e.replace(body=_unmarked(e.body), stream_parallel=False, caller_ops=0) if isinstance(e, ir.ForLoop) else e
        for e in exprs
    ]


@settings(max_examples=40, deadline=None)
@given(programs(), st.sampled_from(["pipelined", "per_iteration"]))
def test_assign_streams_adds_only_stream_ops(program, form):
    """Whatever the form, `assign_streams` moves no op of the loops the pass
    before it built: without its stream ops the program is the loop-only
    one; every loop it assigns is race-free; and the program computes what
    eager torch computes."""
    steps, axes, reduce, reduce_stream, shape, streams = program
    fd = _build(steps, axes, reduce, reduce_stream)
    loops_only = lower(fd.fusion, until="parallelize_streams").program
    assigned = lower(fd.fusion, until="assign_streams", stream_form=form).program
    marked = [e for e in loops_only.exprs if isinstance(e, ir.ForLoop)]
    assert all(e.stream_parallel for e in marked)
    assert not any(isinstance(e, ir.ForLoop) and e.stream_parallel for e in assigned.walk())
    stripped, plain = assigned.derive(), loops_only.derive()
    stripped.exprs, plain.exprs = _without_stream_ops(assigned.exprs), _unmarked(loops_only.exprs)
    assert str(stripped) == str(plain)
    per_loop = 2 if form == "pipelined" else 1
    assert sum(isinstance(e, ir.ForLoop) for e in assigned.exprs) == per_loop * len(marked)
    assert not check_races(assigned)

    program = lower(fd.fusion, stream_form=form).program
    x = torch.randn(shape)
    w = torch.rand(shape) + 0.5
    t = x
    for name in steps:
        t = STEPS[name][1](t, w)
    expected = [t] if reduce is None else [t, t.sum(reduce)]
    outputs = HostIrEvaluator(program).run(dict(zip(program.inputs, [x, w])), number_of_streams=streams)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want)
