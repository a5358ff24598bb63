"""The Python API: definitions, bad input caught before any work, the
lowering cache, and the dump options."""

from __future__ import annotations

import warnings

import pytest
import torch

from hostir import ExecutorParams, FusionDefinition, OptionError, ParallelType
from hostir.options import parse_dump


def _scaled_add():
    """out = x + 2 * y, stream-parallel on axis 0."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1, -1])
        out = fd.ops.add(x, fd.ops.mul(y, 2.0))
        fd.add_output(out)
    out.axis(0).parallelize(ParallelType.stream)
    return fd


def _inputs(shape=(4, 3)):
    return [torch.randn(shape), torch.randn(shape)]


# ---------------------------------------------------------------- definitions


def test_definition_outside_the_with_block_is_an_error():
    fd = _scaled_add()
    with pytest.raises(RuntimeError, match="inside `with FusionDefinition"):
        fd.define_tensor([-1])
    with pytest.raises(RuntimeError, match="inside `with FusionDefinition"):
        fd.ops.set(fd.fusion.inputs[0])


def test_a_fusion_needs_an_output():
    with pytest.raises(ValueError, match="no outputs"):
        with FusionDefinition() as fd:
            fd.define_tensor([-1])


def test_an_input_cannot_be_an_output():
    with pytest.raises(ValueError, match=r"T0 is a fusion input; to return it, add_output\(fd.ops.set\(T0\)\)"):
        with FusionDefinition() as fd:
            fd.add_output(fd.define_tensor([-1]))


@pytest.mark.parametrize("shape", [[-2], [2.5], "ab", 3])
def test_bad_shapes(shape):
    with pytest.raises((ValueError, TypeError), match="shape"):
        with FusionDefinition() as fd:
            fd.define_tensor(shape)


def test_bad_dtype():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        with FusionDefinition() as fd:
            fd.define_tensor([-1], dtype="float32")


def test_operands_of_another_definition_are_rejected():
    with FusionDefinition() as other:
        foreign = other.define_tensor([-1])
        other.add_output(other.ops.set(foreign))
    with pytest.raises(ValueError, match="belongs to another FusionDefinition"):
        with FusionDefinition() as fd:
            fd.ops.set(foreign)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda fd, a, b: fd.ops.add(a, fd.define_tensor([-1])), ValueError, "same number of axes"),
        (lambda fd, a, b: fd.ops.sum(a, [2]), IndexError, "axis 2 is out of range for T0, which has 2 axes"),
        (lambda fd, a, b: fd.ops.sum(a, []), ValueError, "at least one axis"),
        (lambda fd, a, b: fd.ops.max(a, [0, -2]), ValueError, "repeat an axis"),
        (lambda fd, a, b: fd.ops.matmul(a, fd.define_tensor([5, -1])), ValueError, "K of a and b differ: 3 vs 5"),
        (lambda fd, a, b: fd.ops.add(a, "x"), TypeError, "TensorView or a Python number"),
        (lambda fd, a, b: fd.ops.mul(2, 3), TypeError, "at least one TensorView"),
    ],
)
def test_op_definition_errors(build, error, message):
    with pytest.raises(error, match=message):
        with FusionDefinition() as fd:
            a = fd.define_tensor([-1, 3])
            b = fd.define_tensor([-1, -1])
            build(fd, a, b)


def test_axis_index_out_of_range():
    fd = _scaled_add()
    out = fd.fusion.outputs[0]
    with pytest.raises(IndexError, match="axis 2 is out of range for T3, which has 2 axes"):
        out.axis(2)
    assert out.axis(-1) is out.domain[1]


# ---------------------------------------------------------------- bad inputs


def test_wrong_number_of_inputs():
    with pytest.raises(ValueError, match=r"Wrong number of inputs: the fusion takes 2 \(T0: float32\[\?, \?\], T1: float32\[\?, \?\]\), got 1"):
        _scaled_add().execute([torch.randn(4, 3)])


def test_input_that_is_not_a_tensor():
    with pytest.raises(TypeError, match="input 1 \\(T1\\) must be a torch.Tensor, got float"):
        _scaled_add().execute([torch.randn(4, 3), 1.0])


def test_inputs_must_be_a_list():
    with pytest.raises(TypeError, match="inputs must be a list"):
        _scaled_add().execute(torch.randn(4, 3))


def test_wrong_dtype():
    with pytest.raises(TypeError, match="input 0 \\(T0\\): expected dtype torch.float32, got torch.float64"):
        _scaled_add().execute([torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3)])


def test_wrong_rank():
    with pytest.raises(ValueError, match=r"input 1 \(T1\): expected 2 dims, got 3 \(shape \[4, 3, 1\]\)"):
        _scaled_add().execute([torch.randn(4, 3), torch.randn(4, 3, 1)])


def test_fixed_extent_mismatch():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        fd.add_output(fd.ops.set(x))
    with pytest.raises(ValueError, match="input 0 \\(T0\\): axis 1 must have size 8, got 7"):
        fd.execute([torch.randn(2, 7)])


def test_sizes_that_an_op_needs_equal():
    with pytest.raises(ValueError, match=r"input 1 \(T1\) axis 1 has size 5 but input 0 \(T0\) axis 1 has size 3"):
        _scaled_add().execute([torch.randn(4, 3), torch.randn(4, 5)])


def test_matmul_inner_sizes_must_agree():
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.matmul(a, b))
    with pytest.raises(ValueError, match=r"input 1 \(T1\) axis 0 has size 6 but input 0 \(T0\) axis 1 has size 4"):
        fd.execute([torch.randn(3, 4), torch.randn(6, 2)])


def test_input_on_another_device():
    with pytest.raises(ValueError, match="input 1 \\(T1\\) is on meta but the fusion runs on cpu"):
        _scaled_add().execute([torch.randn(4, 3), torch.randn(4, 3, device="meta")])
    with pytest.raises(ValueError, match="input 0 \\(T0\\) is on cpu but the fusion runs on meta"):
        _scaled_add().execute(_inputs(), device="meta")


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "4"])
def test_number_of_streams_must_be_a_positive_integer(n):
    with pytest.raises(ValueError, match="number_of_streams must be an integer >= 1"):
        _scaled_add().execute(_inputs(), number_of_streams=n)


def test_unknown_execution_parameter():
    with pytest.raises(TypeError, match=r"unknown execution parameters \['streams'\]"):
        _scaled_add().execute(_inputs(), streams=2)
    with pytest.raises(ValueError, match="unknown evaluator 'jit'"):
        _scaled_add().execute(_inputs(), evaluator="jit")


def test_params_object():
    fd = _scaled_add()
    x, y = _inputs()
    (out,) = fd.execute([x, y], params=ExecutorParams(number_of_streams=2))
    torch.testing.assert_close(out, x + 2 * y)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: [torch.empty(4, 4)], ValueError, r"preallocated output 0 \(T3\): expected shape \[4, 3\], got \[4, 4\]"),
        (lambda: [torch.empty(4, 3, dtype=torch.float16)], TypeError, "expected dtype torch.float32, got torch.float16"),
        (lambda: [torch.empty(4, 3, device="meta")], ValueError, "is on meta but the fusion runs on cpu"),
        (lambda: [torch.empty(3, 4).t()], ValueError, "must be contiguous"),
        (lambda: [torch.empty(1, 3).expand(4, 3)], ValueError, "must be contiguous"),
        (lambda: [torch.empty(4, 3), torch.empty(4, 3)], ValueError, "all or none preallocated"),
        (lambda: ["x"], TypeError, "must be a torch.Tensor"),
    ],
)
def test_bad_preallocated_outputs(make, error, message):
    with pytest.raises(error, match=message):
        _scaled_add().execute(_inputs(), outputs=make())


def test_output_sharing_memory_with_an_input():
    x, y = _inputs()
    with pytest.raises(ValueError, match=r"shares memory with input 0 \(T0\)"):
        _scaled_add().execute([x, y], outputs=[x])


def test_partial_preallocation():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.set(x))
        fd.add_output(fd.ops.mul(x, 2.0))
    with pytest.raises(ValueError, match=r"all or none preallocated: outputs \[1\] are None"):
        fd.execute([torch.randn(3)], outputs=[torch.empty(3), None])
    out = fd.execute([torch.randn(3)], outputs=[None, None])
    assert len(out) == 2


def test_bad_input_is_caught_before_any_work():
    """A preallocated output is untouched when a later check fails."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.set(x))
        fd.add_output(fd.ops.mul(x, 2.0))
    first = torch.full((3,), 7.0)
    with pytest.raises(ValueError):
        fd.execute([torch.randn(3)], outputs=[first, torch.empty(4)])
    assert torch.equal(first, torch.full((3,), 7.0))


def test_inputs_requiring_grad_record_a_backward():
    fd = _scaled_add()
    x, y = (t.requires_grad_() for t in _inputs())
    (out,) = fd.execute([x, y])
    assert out.grad_fn is not None
    torch.testing.assert_close(out, (x + 2 * y).detach())
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    torch.testing.assert_close(y.grad, torch.full_like(y, 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            (out,) = fd.execute([x, y])  # no autograd asked for, none recorded, no warning
    assert not out.requires_grad


def test_non_contiguous_inputs(device):
    fd = _scaled_add()
    x = torch.randn(3, 4, device=device).t()
    y = torch.randn(4, 3, device=device)
    (out,) = fd.execute([x, y])
    torch.testing.assert_close(out, x + 2 * y)


def test_zero_size_inputs(device):
    fd = _scaled_add()
    x, y = torch.randn(0, 3, device=device), torch.randn(0, 3, device=device)
    (out,) = fd.execute([x, y])
    assert out.shape == (0, 3)


# ---------------------------------------------------------------- caching


def test_one_lowering_serves_every_shape():
    fd = _scaled_add()
    for shape in [(4, 3), (9, 1), (1, 17)]:
        x, y = _inputs(shape)
        torch.testing.assert_close(fd.execute([x, y])[0], x + 2 * y)
    assert fd.executor.lowerings == 1


def test_contiguity_is_part_of_the_signature():
    fd = _scaled_add()
    x, y = _inputs()
    fd.execute([x, y])
    fd.execute([torch.randn(3, 4).t(), y])
    assert fd.executor.num_programs == 2
    fd.execute([x, y])
    assert fd.executor.lowerings == 2


def test_changing_the_schedule_lowers_again():
    fd = _scaled_add()
    x, y = _inputs()
    fd.execute([x, y])
    assert "FOR StreamIdx" in fd.host_ir()
    fd.fusion.outputs[0].axis(0).parallelize(ParallelType.serial)
    (out,) = fd.execute([x, y])
    torch.testing.assert_close(out, x + 2 * y)
    assert "FOR StreamIdx" not in fd.host_ir()
    assert fd.executor.lowerings == 2
    assert fd.executor.num_programs == 1


# ---------------------------------------------------------------- dumps


def test_host_ir_dump_prints_on_first_execution_only(monkeypatch, capsys):
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    fd = _scaled_add()
    fd.execute(_inputs())
    first = capsys.readouterr().out
    assert first == "Host program:\n" + fd.host_ir() + f"{fd.last_runner}\n"
    fd.execute(_inputs())
    assert capsys.readouterr().out == ""


def test_nvfuser_dump_variable_is_read_too(monkeypatch, capsys):
    monkeypatch.setenv("NVFUSER_DUMP", "host_ir")
    _scaled_add().execute(_inputs())
    assert "%HostIrContainer {" in capsys.readouterr().out


def test_lowering_dump_names_every_pass(monkeypatch, capsys):
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir_lowering,fusion_ir")
    _scaled_add().execute(_inputs())
    out = capsys.readouterr().out
    assert out.index("Fusion:\n%Fusion {") < out.index("Host program after pass build_host_program:")
    assert out.index("Host program after pass build_host_program:") < out.index(
        "Host program after pass parallelize_streams:"
    )


def test_dump_ranks_limit_who_prints(monkeypatch, capsys):
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    monkeypatch.setenv("HOSTIR_DUMP_RANKS", "1")
    _scaled_add().execute(_inputs())
    assert capsys.readouterr().out == ""


def test_unknown_dump_option_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir,bogus")
    with pytest.raises(OptionError, match=r"(?s)unknown option 'bogus'. Valid options:.*host_ir_lowering"):
        _scaled_add().execute(_inputs())


@pytest.mark.parametrize("text", ["host_ir(", "host ir", "host_ir;x"])
def test_malformed_dump_option(text):
    with pytest.raises(OptionError, match="is not an option name"):
        parse_dump(text)


def test_repr_prints_the_fusion():
    fd = _scaled_add()
    text = repr(fd)
    assert text.startswith("%Fusion { (T0_g_float[iS0{i0}, iS1{i1}], T1_g_float[iS2{i2}, iS3{i3}]) -> (T3_l_float[")
    assert text.endswith("} // %Fusion\n")
