"""The flat program and the C++ executor against the Python evaluator.

Every golden program of the stream-parallelization pass is compiled to a flat
program (golden dump `flat_<case>.hir`) and run on both evaluators on the
same random inputs: the results must be identical, bit for bit. Errors must
read the same, and a run must be re-entrant (two threads at once).
"""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest
import torch

from conftest import check_golden
from hostir import FusionDefinition, HostIrRuntimeError, ParallelType, cpp, ir
from hostir.container import HostIrContainer
from hostir.runtime.evaluator import BindingError, HostIrEvaluator
from hostir.runtime.flat import compile_program
from hostir.lower import lower
from hostir.options import OptionError, evaluator_choice
from test_stream_lowering import CASES, _define

needs_cpp = pytest.mark.skipif(not cpp.available(), reason=f"hostir._C is not built: {cpp.reason()}")


def _inputs(shapes, device="cpu"):
    return [torch.randn(s, device=device) for s in shapes]


@pytest.mark.parametrize("case", sorted(CASES))
def test_flat_program_dump(case):
    build, _, _ = CASES[case]
    fd = _define(build)
    check_golden(f"flat_{case}", compile_program(lower(fd.fusion).program).dump())


@needs_cpp
@pytest.mark.parametrize("number_of_streams", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpp_matches_python_bit_for_bit(case, number_of_streams, device):
    build, shapes, reference = CASES[case]
    fd = _define(build)
    inputs = _inputs(shapes, device)
    python = fd.execute(inputs, number_of_streams=number_of_streams, evaluator="python")
    compiled = fd.execute(inputs, number_of_streams=number_of_streams, evaluator="cpp")
    assert len(python) == len(compiled)
    for p, c in zip(python, compiled):
        assert p.dtype == c.dtype and p.shape == c.shape
        assert torch.equal(p, c)
    for c, r in zip(compiled, reference(*inputs)):
        torch.testing.assert_close(c, r)


@needs_cpp
@pytest.mark.parametrize("case", ["matmul_m", "linear_n_bias", "reduction_kept_axis"])
def test_cpp_writes_preallocated_outputs(case):
    build, shapes, reference = CASES[case]
    fd = _define(build)
    inputs = _inputs(shapes)
    expected = reference(*inputs)
    bufs = [torch.empty_like(t) for t in expected]
    outs = fd.execute(inputs, outputs=bufs, evaluator="cpp")
    for out, buf, r in zip(outs, bufs, expected):
        assert out is buf
        torch.testing.assert_close(buf, r)


def _hand_built():
    c = HostIrContainer()
    t0 = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.symbolic(c))], torch.float32, ir.MemoryType.global_)
    c.add_input(t0)
    return c, t0


def _failing_loop():
    c, t0 = _hand_built()
    index = ir.Scalar(label="i")
    piece = ir.TensorView(c, [], torch.float32)
    out = ir.TensorView(c, [], torch.float32)
    body = [ir.HirAliasSelect(piece, t0, t0.domain[0], index), ir.Set(out, piece)]
    c.push_back(ir.ForLoop(index, ir.Scalar.constant(0), ir.Scalar.constant(4), body))
    c.add_output(t0)
    return c, t0


@needs_cpp
def test_errors_read_the_same_on_both_evaluators():
    """torch's own error (a select out of range) keeps its type on both, with
    the same message and the same note naming the op and the loop index."""
    c, t0 = _failing_loop()
    x = torch.randn(2)
    seen = []
    for make in (HostIrEvaluator, cpp.CppEvaluator):
        with pytest.raises(IndexError) as err:
            make(c).run({t0: x})
        seen.append((type(err.value), str(err.value), err.value.__notes__))
    assert seen[0] == seen[1]
    assert seen[1][2][0].endswith("in loop i = 2")


@needs_cpp
def test_hostir_errors_read_the_same_on_both_evaluators():
    """An unbound value is hostir's error: a HostIrRuntimeError quoting the op."""
    c = HostIrContainer()
    domain = [ir.IterDomain(c, ir.Scalar.symbolic(c))]
    t0 = ir.TensorView(c, domain, torch.float32, ir.MemoryType.global_)
    t1 = ir.TensorView(c, [domain[0].clone(c)], torch.float32, ir.MemoryType.global_)
    c.push_back(ir.Set(t1, t0))
    c.add_output(t1)
    messages = []
    for make in (HostIrEvaluator, cpp.CppEvaluator):
        with pytest.raises(HostIrRuntimeError) as err:
            make(c).run({})
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert messages[1].startswith("UnboundValueError: value T0_g_float[iS0{i0}] is not bound\nWhile executing:")


@needs_cpp
def test_bad_bindings_read_the_same(device):
    """A bad binding is a BindingError on both evaluators, with the same
    text, and leaves the evaluator usable: the next good run works."""
    c, t0 = _hand_built()
    c.add_output(t0)
    for bad in ({"number_of_streams": 0}, {"bindings": {t0: torch.randn(2, 2, device=device)}}):
        messages = []
        for make in (HostIrEvaluator, cpp.CppEvaluator):
            evaluator = make(c, device=device)
            with pytest.raises(BindingError) as err:
                evaluator.run(
                    bad.get("bindings", {t0: torch.randn(2, device=device)}),
                    number_of_streams=bad.get("number_of_streams", 4),
                )
            messages.append(str(err.value))
            x = torch.randn(3, device=device)
            (out,) = evaluator.run({t0: x})
            assert torch.equal(out, x)
        assert messages[0] == messages[1], messages


@needs_cpp
def test_each_iteration_writes_a_fresh_buffer_in_cpp():
    """Loop-local values are unbound each iteration: every iteration's
    product is a new tensor, so the stacked results are all different."""
    c, t0 = _hand_built()
    index = ir.Scalar(label="i")
    piece = ir.TensorView(c, [], torch.float32)
    doubled = ir.TensorView(c, [], torch.float32)
    whole = ir.TensorView(c, [t0.domain[0].clone(c)], torch.float32, ir.MemoryType.global_)
    slot = ir.TensorView(c, [], torch.float32)
    c.push_back(ir.Allocate(whole))
    body = [
        ir.HirAliasSelect(piece, t0, t0.domain[0], index),
        ir.BinaryOp(doubled, "mul", piece, ir.Scalar.constant(2)),
        ir.HirAliasSelect(slot, whole, whole.domain[0], index),
        ir.Set(slot, doubled),
    ]
    c.push_back(ir.ForLoop(index, ir.Scalar.constant(0), t0.domain[0].extent, body))
    c.add_output(whole)
    x = torch.randn(3)
    (out,) = cpp.CppEvaluator(c).run({t0: x})
    torch.testing.assert_close(out, x * 2)
    flat = compile_program(c)
    (loop,) = [i for i in flat.instrs if i.op == "for"]
    assert {flat.tensor_names[s].split("_")[0] for s in loop.fields["locals"]} == {"T1", "T2", "T4"}


@needs_cpp
def test_two_threads_run_one_program_at_once():
    build, shapes, reference = CASES["chain_then_matmul"]
    fd = _define(build)
    fd.execute(_inputs(shapes), evaluator="cpp")
    results, errors = {}, []

    def work(k):
        try:
            for _ in range(20):
                inputs = _inputs(shapes)
                (out,) = fd.execute(inputs, evaluator="cpp")
                torch.testing.assert_close(out, reference(*inputs)[0])
            results[k] = True
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == {0: True, 1: True}
    assert fd.executor.num_programs == 1


def test_cuda_graph_on_cpu_is_a_clear_error():
    build, shapes, _ = CASES["single_set"]
    fd = _define(build)
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device, but the fusion runs on cpu"):
        fd.execute(_inputs(shapes), cuda_graph=True)


def test_unknown_evaluator_is_rejected(monkeypatch):
    fd = _define(CASES["single_set"][0])
    with pytest.raises(ValueError, match="unknown evaluator 'fast'"):
        fd.execute(_inputs([(2, 2)]), evaluator="fast")
    monkeypatch.setenv("HOSTIR_EVALUATOR", "fast")
    with pytest.raises(OptionError, match="HOSTIR_EVALUATOR='fast'"):
        evaluator_choice()


def test_flat_program_dump_option(monkeypatch, capsys):
    monkeypatch.setenv("HOSTIR_DUMP", "flat_program")
    fd = _define(CASES["single_set"][0])
    if not cpp.available():
        pytest.skip("hostir._C is not built")
    fd.execute(_inputs([(4, 3)]), evaluator="cpp")
    assert "%FlatProgram {" in capsys.readouterr().out


def test_printer_depends_on_ir_never_the_reverse():
    source = (pathlib.Path(ir.__file__)).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not any("printer" in name for name in imported if name), imported


@pytest.mark.cuda
def test_cuda_graph_replays_into_the_same_outputs(cuda_device):
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, -1])
        c = fd.ops.matmul(a, b)
        d = fd.ops.mul(c, 3.0)
        fd.add_output(d)
    c.axis(0).parallelize(ParallelType.stream)
    d.axis(0).parallelize(ParallelType.stream)
    x, w = torch.randn(4, 8, 16, device="cuda"), torch.randn(16, 8, device="cuda")
    out = torch.empty(4, 8, 8, device="cuda")
    fd.execute([x, w], outputs=[out], cuda_graph=True)
    torch.testing.assert_close(out, (x @ w) * 3)
    x2 = torch.randn_like(x)
    (again,) = fd.execute([x2, w], outputs=[out], cuda_graph=True)
    assert again is out
    torch.testing.assert_close(out, (x2 @ w) * 3)
    assert len(fd.executor._graphs) == 1
    # Another size is another graph.
    x3 = torch.randn(2, 8, 16, device="cuda")
    out3 = torch.empty(2, 8, 8, device="cuda")
    fd.execute([x3, w], outputs=[out3], cuda_graph=True)
    torch.testing.assert_close(out3, (x3 @ w) * 3)
    assert len(fd.executor._graphs) == 2


def test_unsupported_names_what_only_python_runs():
    """`auto` runs such a program on the Python evaluator; compiling it for
    the C++ executor is an error that names the op."""
    from hostir.runtime.evaluator import MissingHandlerError
    from hostir.runtime.flat import unsupported

    class Mystery(ir.Expr):
        pass

    c, t0 = _hand_built()
    c.add_output(t0)
    assert unsupported(c) is None
    c.push_back(Mystery())
    assert unsupported(c) == "it has no instruction for Mystery"
    with pytest.raises(MissingHandlerError, match="cannot run this program: it has no instruction for Mystery"):
        compile_program(c)


def _coalesced_p2p(backends):
    """A StartCoalescing, one P2P send per backend, EndCoalescing, Wait."""
    c = HostIrContainer()
    x = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_)
    c.add_input(x)
    end = ir.EndCoalescing(c.next_name("comm"))
    sends = [ir.P2PCommunication(c.next_name("comm"), "send", x, ir.Scalar.constant(1), backend=b) for b in backends]
    for e in [ir.StartCoalescing(), *sends, end, ir.Wait(end)]:
        c.push_back(e)
    return c


def test_each_communication_instruction_names_its_backend():
    """The C++ executor chooses each P2P's, collective's and coalescing
    group's transport by the backend its instruction names: a group's is its
    first member's, and an empty group names none."""
    import types

    comm = types.SimpleNamespace(rank=0, world_size=2)
    p = compile_program(_coalesced_p2p(["gloo", "gloo"]), comm)
    assert [(i.op, i.fields.get("backend")) for i in p.instrs] == [
        ("start_coalescing", "gloo"),
        ("p2p", "gloo"),
        ("p2p", "gloo"),
        ("end_coalescing", "gloo"),
        ("wait", None),
    ]
    assert "backend=gloo" in p.dump()
    empty = compile_program(_coalesced_p2p([]), comm)
    assert [i.fields.get("backend") for i in empty.instrs] == ["", "", None]
    assert "0: start_coalescing backend=-" in empty.dump()
