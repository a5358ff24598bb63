"""The fast path of a repeated call (`hostir.runtime.prepared`): a call whose exact
signature already ran skips the checks and the program lookup, and any
other call takes the full path, with the full path's error.

Each bad call is made twice: on a fusion that just ran a good call of a
nearby signature (so a record exists), and on a fresh fusion (no record);
both must raise the same error with the same text.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hostir
from hostir import FusionDefinition, ParallelType
from hostir.executor import ExecutorParams, InputError


def _define(stream: bool = False) -> FusionDefinition:
    """out = (a + b) * 3.0, optionally over a stream loop on axis 0."""
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        c = fd.ops.add(a, b)
        d = fd.ops.mul(c, 3.0)
        fd.add_output(d)
    if stream:
        c.axis(0).parallelize(ParallelType.stream)
        d.axis(0).parallelize(ParallelType.stream)
    return fd


def _reference(a, b):
    return (a + b) * 3.0


def _error(fd, inputs, outputs=None, **kwargs) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fd.execute(inputs, outputs, **kwargs)
    return type(info.value), str(info.value)


def _warmed(**kwargs) -> FusionDefinition:
    """A fusion with the record of a good call of 4x5 float32 inputs."""
    fd = _define(kwargs.pop("stream", False))
    for _ in range(2):
        a, b = torch.randn(4, 5), torch.randn(4, 5)
        (out,) = fd.execute([a, b], **kwargs)
        torch.testing.assert_close(out, _reference(a, b))
    assert len(fd.executor._prepared) == 1
    return fd


@pytest.mark.parametrize("stream", [False, True], ids=["flat", "stream_loop"])
def test_repeated_calls_skip_the_full_path_and_match_eager(evaluator, stream, monkeypatch):
    fd = _warmed(stream=stream, number_of_streams=2)
    full_path = []
    real = fd.executor._normalize
    monkeypatch.setattr(fd.executor, "_normalize", lambda *a, **k: full_path.append(1) or real(*a, **k))
    for _ in range(3):
        a, b = torch.randn(4, 5), torch.randn(4, 5)
        (out,) = fd.execute([a, b], number_of_streams=2)
        torch.testing.assert_close(out, _reference(a, b))
    assert full_path == []
    # Another shape is another signature: the full path, then a record.
    a, b = torch.randn(3, 7), torch.randn(3, 7)
    (out,) = fd.execute([a, b], number_of_streams=2)
    torch.testing.assert_close(out, _reference(a, b))
    assert full_path == [1]
    assert len(fd.executor._prepared) == 2
    assert fd.executor.lowerings == 1  # one program serves every shape


def test_preallocated_outputs_on_the_fast_path(evaluator):
    fd = _define(stream=True)
    for _ in range(3):
        a, b = torch.randn(4, 5), torch.randn(4, 5)
        out = torch.empty(4, 5)
        (got,) = fd.execute([a, b], [out])
        assert got is out
        torch.testing.assert_close(out, _reference(a, b))
    assert len(fd.executor._prepared) == 1


BAD_CALLS = {
    "shape": lambda: ([torch.randn(4, 5), torch.randn(4, 6)], None),
    "dims": lambda: ([torch.randn(4, 5), torch.randn(4, 5, 1)], None),
    "dtype": lambda: ([torch.randn(4, 5), torch.randn(4, 5, dtype=torch.float64)], None),
    "device": lambda: ([torch.randn(4, 5), torch.randn(4, 5, device="meta")], None),
    "count": lambda: ([torch.randn(4, 5)], None),
    "not a tensor": lambda: ([torch.randn(4, 5), [[1.0] * 5] * 4], None),
    "output shape": lambda: ([torch.randn(4, 5), torch.randn(4, 5)], [torch.empty(4, 6)]),
    "output dtype": lambda: ([torch.randn(4, 5), torch.randn(4, 5)], [torch.empty(4, 5, dtype=torch.float64)]),
    "output strides": lambda: ([torch.randn(4, 5), torch.randn(4, 5)], [torch.empty(5, 4).t()]),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("stream", [False, True], ids=["flat", "stream_loop"])
def test_a_bad_call_after_a_good_one_gets_the_full_paths_error(evaluator, case, stream):
    inputs, outputs = BAD_CALLS[case]()
    warmed = _warmed(stream=stream)
    if outputs is not None:
        # A record with preallocated outputs too.
        good = torch.empty(4, 5)
        warmed.execute([torch.randn(4, 5), torch.randn(4, 5)], [good])
    expected = _error(_define(stream), inputs, outputs)
    assert _error(warmed, inputs, outputs) == expected
    assert issubclass(expected[0], hostir.HostIrError)


def test_changed_strides_take_the_full_path(evaluator):
    fd = _warmed()
    a = torch.randn(5, 4).t()  # the same shape, other strides
    b = torch.randn(4, 5)
    (out,) = fd.execute([a, b])
    torch.testing.assert_close(out, _reference(a, b))
    assert len(fd.executor._prepared) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["flat", "stream_loop"])
def test_an_output_aliasing_an_input_is_caught_on_the_fast_path(evaluator, stream):
    fd = _define(stream)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    fd.execute([a, b], [torch.empty(4, 5)])
    fd.execute([a, b], [torch.empty(4, 5)])
    assert len(fd.executor._prepared) == 1
    # The same signature as the record's: only the addresses differ.
    for bad in (a, b):
        before = bad.clone()
        kind, text = _error(fd, [a, b], [bad])
        assert (kind, text) == _error(_define(stream), [a, b], [bad])
        assert kind is InputError and "shares memory with input" in text
        assert torch.equal(bad, before)  # nothing ran


def test_a_partial_overlap_is_caught_on_the_fast_path(evaluator):
    fd = _define()
    whole = torch.randn(8, 5)
    a, b = whole[:4], torch.randn(4, 5)
    out = torch.empty(8, 5)
    fd.execute([a, b], [out[4:]])
    fd.execute([a, b], [out[4:]])
    kind, text = _error(fd, [a, b], [whole[2:6]])
    assert kind is InputError and "preallocated output 0 (T" in text and "shares memory with input 0" in text


def test_requires_grad_is_part_of_the_signature(evaluator):
    fd = _warmed()
    a, b = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5)
    with torch.no_grad():
        (out,) = fd.execute([a, b])
    assert not out.requires_grad
    torch.testing.assert_close(out, _reference(a, b).detach())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            (out,) = fd.execute([a, b])
    assert not out.requires_grad
    # With grad mode on, the same inputs record a backward.
    (out,) = fd.execute([a, b])
    assert out.grad_fn is not None


def test_a_changed_fusion_is_lowered_again(evaluator):
    fd = _warmed()
    assert fd.executor.lowerings == 1
    fd.fusion.outputs[0].axis(0).parallelize(ParallelType.stream)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    (out,) = fd.execute([a, b])
    torch.testing.assert_close(out, _reference(a, b))
    assert fd.executor.lowerings == 2


def test_the_evaluator_variable_is_read_on_every_call(monkeypatch):
    if not hostir.cpp.available():
        pytest.skip("hostir._C is not built")
    monkeypatch.setenv("HOSTIR_EVALUATOR", "python")
    fd = _warmed()
    monkeypatch.setenv("HOSTIR_EVALUATOR", "cpp")
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    (out,) = fd.execute([a, b])
    torch.testing.assert_close(out, _reference(a, b))
    kinds = sorted(type(p.evaluator).__name__ for p in fd.executor._programs.values())
    assert kinds == ["CppEvaluator", "HostIrEvaluator"]
    monkeypatch.setenv("HOSTIR_EVALUATOR", "fast")
    with pytest.raises(hostir.options.OptionError, match="HOSTIR_EVALUATOR='fast'"):
        fd.execute([a, b])


def test_fake_modes_are_read_on_every_call(monkeypatch):
    fd = _warmed()
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    monkeypatch.setenv("HOSTIR_FAKE", "1")
    (out,) = fd.execute([a, b])
    assert out.device.type == "meta" and out.shape == (4, 5)
    monkeypatch.setenv("HOSTIR_FAKE", "maybe")
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="HOSTIR_FAKE='maybe'"):
            (out,) = fd.execute([a, b])
        torch.testing.assert_close(out, _reference(a, b))


def test_changed_parameters_are_another_signature(evaluator):
    fd = _define(stream=True)
    params = ExecutorParams(number_of_streams=2)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    fd.execute([a, b], params=params)
    fd.execute([a, b], params=params)
    params.number_of_streams = 0
    with pytest.raises(hostir.executor.ExecuteArgumentError, match="number_of_streams must be an integer >= 1, got 0"):
        fd.execute([a, b], params=params)
    kind, text = _error(fd, [a, b], number_of_streams=-1)
    assert "got -1" in text


@pytest.mark.parametrize(
    "bad", [{"number_of_streams": True}, {"number_of_streams": 4.0}, {"cuda_graph": 0}, {"evaluator": "fast"}]
)
def test_parameters_equal_to_good_ones_but_of_another_type_are_refused(evaluator, bad):
    (name, value), = bad.items()
    good = {"number_of_streams": 1 if value is True else 4, "cuda_graph": False, "evaluator": evaluator}[name]
    fd = _warmed(**{name: good})
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    expected = _error(_define(), [a, b], **bad)
    assert _error(fd, [a, b], **bad) == expected
    assert issubclass(expected[0], hostir.HostIrError)


def test_a_profiler_sees_every_op_after_a_record(monkeypatch):
    """With a profiler on, `auto` runs the Python evaluator, which reports
    each op as a range, even where a record of the C++ executor exists."""
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    fd = _warmed(stream=True)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    with torch.profiler.profile() as prof:
        (out,) = fd.execute([a, b])
    torch.testing.assert_close(out, _reference(a, b))
    names = {e.name for e in prof.events()}
    assert "FOR StreamIdx" in names and "add T6" in names, sorted(names)


def test_a_debug_log_reports_every_cache_lookup(evaluator, caplog):
    fd = _warmed()
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    with caplog.at_level("DEBUG", logger="hostir"):
        fd.execute([a, b])
    assert any("program cache hit" in r.getMessage() for r in caplog.records)


@pytest.mark.cuda
def test_cuda_graph_replays_from_the_record(cuda_device, monkeypatch):
    if not hostir.cpp.available():
        pytest.skip("hostir._C is not built")
    monkeypatch.setenv("HOSTIR_EVALUATOR", "cpp")
    fd = _define(stream=True)
    a, b = torch.randn(4, 5, device="cuda"), torch.randn(4, 5, device="cuda")
    (first,) = fd.execute([a, b], cuda_graph=True)
    torch.testing.assert_close(first, _reference(a, b))
    for _ in range(3):
        a2, b2 = torch.randn_like(a), torch.randn_like(b)
        (out,) = fd.execute([a2, b2], cuda_graph=True)
        assert out is first  # the graph's own output
        torch.testing.assert_close(out, _reference(a2, b2))
    assert len(fd.executor._graphs) == 1 and len(fd.executor._prepared) == 1
    # Preallocated outputs: the captured ones are replayed into, others
    # get another graph, and an aliasing one is refused.
    out = torch.empty(4, 5, device="cuda")
    fd.execute([a, b], [out], cuda_graph=True)
    (got,) = fd.execute([a2, b2], [out], cuda_graph=True)
    assert got is out
    torch.testing.assert_close(out, _reference(a2, b2))
    other = torch.empty(4, 5, device="cuda")
    (got,) = fd.execute([a, b], [other], cuda_graph=True)
    torch.testing.assert_close(other, _reference(a, b))
    assert len(fd.executor._graphs) == 3
    with pytest.raises(InputError, match="shares memory with input 0"):
        fd.execute([a, b], [a], cuda_graph=True)
    torch.cuda.synchronize()


def test_graph_inputs_are_replayed_without_a_copy(cuda_device, monkeypatch):
    """`fd.graph_inputs` returns the captured graph's input buffers; values
    written into them are what the next replay reads, and passing them
    copies nothing into the graph."""
    if not hostir.cpp.available():
        pytest.skip("hostir._C is not built")
    monkeypatch.setenv("HOSTIR_EVALUATOR", "cpp")
    fd = _define(stream=True)
    a, b = torch.randn(4, 5, device="cuda"), torch.randn(4, 5, device="cuda")
    ga, gb = fd.graph_inputs([a, b], cuda_graph=True)
    assert ga.data_ptr() != a.data_ptr()
    torch.testing.assert_close(ga, a)  # the capture's clones of the inputs
    assert [t.data_ptr() for t in fd.graph_inputs([a, b], cuda_graph=True)] == [ga.data_ptr(), gb.data_ptr()]
    assert len(fd.executor._graphs) == 1
    real_copy = torch.Tensor.copy_
    for _ in range(3):
        a2, b2 = torch.randn_like(a), torch.randn_like(b)
        ga.copy_(a2)
        gb.copy_(b2)
        copied = []
        monkeypatch.setattr(
            torch.Tensor, "copy_", lambda self, src, *args, **kw: copied.append(self) or real_copy(self, src, *args, **kw)
        )
        (out,) = fd.execute([ga, gb], cuda_graph=True)
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        assert copied == []
        torch.testing.assert_close(out, _reference(a2, b2))
    assert len(fd.executor._graphs) == 1
    torch.cuda.synchronize()


def test_graph_inputs_refuse_calls_that_are_not_graph_replays():
    fd = _define()
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    with pytest.raises(hostir.UsageError, match="pass cuda_graph=True"):
        fd.graph_inputs([a, b])
    with pytest.raises(hostir.HostIrError, match="(?i)cuda"):
        fd.graph_inputs([a, b], cuda_graph=True)  # on the CPU: no graph can be captured
