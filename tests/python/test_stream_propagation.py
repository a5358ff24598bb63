"""Stream axes on split axes and on inputs, and their propagation.

`propagate_stream_axes` has golden dumps of its own (the pass alone after
`build_host_program`); every program also has a golden dump of the whole
pipeline and runs against eager torch on random data, for several numbers of
streams and for row counts that the chunk count divides, does not divide
(a ragged last chunk) and exceeds (empty chunks).
"""

from __future__ import annotations

import pytest
import torch

from conftest import check_golden
from hostir import FusionDefinition, LoweringError, ParallelType
from hostir.lower import run_passes
from hostir.lower.build_host_program import build_host_program
from hostir.lower.propagate_stream_axes import propagate_stream_axes

STREAM = ParallelType.stream
linear = torch.nn.functional.linear


def split_output(fd):
    """An unscheduled add feeding a mul whose rows are split into 2 chunks."""
    x = fd.define_tensor([-1, -1])
    w = fd.define_tensor([-1, -1])
    z = fd.ops.mul(fd.ops.add(x, w), 2.0)
    fd.add_output(z)
    z.outer_split(0, 2)
    z.axis(0).parallelize(STREAM)
    return lambda rows: [torch.randn(rows, 6), torch.randn(rows, 6)], lambda x, w: [(x + w) * 2.0]


def split_columns(fd):
    """Columns split into 3 chunks: each chunk is a strided view."""
    x = fd.define_tensor([-1, -1])
    y = fd.ops.sub(x, 1.0)
    fd.add_output(y)
    y.outer_split(1, 3)
    y.axis(1).parallelize(STREAM)
    return lambda rows: [torch.randn(5, rows)], lambda x: [x - 1.0]


def split_input(fd):
    """A stream axis on an input's split rows: the matmul takes it on."""
    x = fd.define_tensor([-1, -1])
    b = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.matmul(x, b))
    x.outer_split(0, 3)
    x.axis(0).parallelize(STREAM)
    return lambda rows: [torch.randn(rows, 8), torch.randn(8, 5)], lambda x, b: [x @ b]


def forward_to_consumer(fd):
    x = fd.define_tensor([-1, -1])
    y = fd.ops.set(x)
    z = fd.ops.mul(y, 0.5)
    fd.add_output(z)
    y.axis(0).parallelize(STREAM)
    return lambda rows: [torch.randn(rows, 3)], lambda x: [x * 0.5]


def backward_to_producer(fd):
    x = fd.define_tensor([-1, -1])
    y = fd.ops.mul(x, 2.0)
    z = fd.ops.add(y, x)
    fd.add_output(z)
    z.axis(1).parallelize(STREAM)
    return lambda rows: [torch.randn(rows, 5)], lambda x: [x * 2.0 + x]


def two_matmuls(fd):
    """Two matmuls streamed on different axes, M in 2 chunks then N in 3."""
    a = fd.define_tensor([-1, -1])
    b = fd.define_tensor([-1, -1])
    c = fd.define_tensor([-1, -1])
    x = fd.ops.matmul(a, b)
    y = fd.ops.matmul(x, c)
    fd.add_output(y)
    x.outer_split(0, 2)
    x.axis(0).parallelize(STREAM)
    y.outer_split(1, 3)
    y.axis(1).parallelize(STREAM)
    return (
        lambda rows: [torch.randn(rows, 4), torch.randn(4, 6), torch.randn(6, rows + 1)],
        lambda a, b, c: [a @ b @ c],
    )


def linear_split_rows(fd):
    x = fd.define_tensor([-1, -1, -1])
    w = fd.define_tensor([-1, -1])
    bias = fd.define_tensor([-1])
    y = fd.ops.linear(x, w, bias)
    fd.add_output(y)
    y.outer_split(1, 2)
    y.axis(1).parallelize(STREAM)
    return (
        lambda rows: [torch.randn(2, rows, 4), torch.randn(3, 4), torch.randn(3)],
        lambda x, w, b: [linear(x, w, b)],
    )


def reduction_after_split(fd):
    """A sum that keeps the split rows, in the loop of the set before it."""
    x = fd.define_tensor([-1, -1])
    y = fd.ops.set(x)
    s = fd.ops.sum(y, [1])
    fd.add_output(s)
    y.outer_split(0, 4)
    y.axis(0).parallelize(STREAM)
    return lambda rows: [torch.randn(rows, 3)], lambda x: [x.sum(1)]


CASES = {
    f.__name__: f
    for f in (
        split_output,
        split_columns,
        split_input,
        forward_to_consumer,
        backward_to_producer,
        two_matmuls,
        linear_split_rows,
        reduction_after_split,
    )
}


def _define(build):
    with FusionDefinition() as fd:
        make, reference = build(fd)
    return fd, make, reference


@pytest.mark.parametrize("case", sorted(CASES))
def test_propagation_golden_dump(case):
    fd, _, _ = _define(CASES[case])
    text = str(run_passes(build_host_program(fd.fusion), [propagate_stream_axes]))
    check_golden(f"propagate_{case}", text)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_golden_dump(case):
    fd, _, _ = _define(CASES[case])
    check_golden(f"streamed_{case}", fd.host_ir())


@pytest.mark.parametrize("rows", [12, 7, 2, 0])
@pytest.mark.parametrize("number_of_streams", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case, number_of_streams, rows, device):
    fd, make, reference = _define(CASES[case])
    torch.manual_seed(rows)
    inputs = [t.to(device) for t in make(rows)]
    outputs = fd.execute(inputs, number_of_streams=number_of_streams)
    expected = reference(*inputs)
    assert [list(o.shape) for o in outputs] == [list(e.shape) for e in expected]
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref)


def test_preallocated_output_of_a_split_axis_has_its_logical_shape():
    fd, make, reference = _define(split_output)
    inputs = make(7)
    out = torch.empty(7, 6)
    (got,) = fd.execute(inputs, outputs=[out])
    assert got is out
    torch.testing.assert_close(out, reference(*inputs)[0])
    with pytest.raises(ValueError, match=r"expected shape \[7, 6\], got \[2, 4, 6\]"):
        fd.execute(inputs, outputs=[torch.empty(2, 4, 6)])


def test_one_program_serves_divisible_and_ragged_rows():
    fd, make, reference = _define(split_output)
    for rows in (8, 5, 1):
        inputs = make(rows)
        torch.testing.assert_close(fd.execute(inputs)[0], reference(*inputs)[0])
    assert fd.executor.lowerings == 1


def test_stream_on_the_inner_piece_of_a_split_is_an_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    y.split(0, 2)
    y.axis(1).parallelize(STREAM)
    with pytest.raises(LoweringError, match="inner piece of a split axis.*outer_split"):
        fd.host_ir()


def test_operand_split_another_way_is_an_error():
    """The streamed rows come in 2 chunks but the operand is split in 3:
    refused when lowering, never a wrong or crashing chunk."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.outer_split(0, 3)
    y.outer_split(0, 2)
    y.axis(0).parallelize(STREAM)
    with pytest.raises(LoweringError, match=r"T0_g_float.* is split differently from the stream axis"):
        fd.host_ir()


def test_propagation_leaves_the_users_fusion_unchanged():
    fd, _, _ = _define(forward_to_consumer)
    before = repr(fd)
    fd.host_ir()
    assert repr(fd) == before
