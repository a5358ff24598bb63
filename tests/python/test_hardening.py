"""Nothing is silently wrong: concurrent calls, aliased outputs, errors and
their classes, dump options, inputs on the wrong device."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import pkgutil
import threading
import warnings

import pytest
import torch

import hostir
from hostir import FusionDefinition, HostIrError, InputError, ParallelType

PACKAGE = pathlib.Path(hostir.__file__).parent


def _stream_matmul_add():
    """out = (a @ w) + b with a stream axis on out's rows: a loop of
    HirAliasSelect slices, as in the stream-parallel example."""
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        out = fd.ops.add(fd.ops.matmul(a, w), b)
        fd.add_output(out)
    out.axis(0).parallelize(ParallelType.stream)
    return fd


# ---------------------------------------------------------------- threads


@pytest.mark.timeout(240)
def test_threads_executing_one_fusion_each_get_their_own_result():
    fd = _stream_matmul_add()
    fd.execute([torch.randn(8, 4), torch.randn(4, 3), torch.randn(8, 3)])  # lower once
    failures: list[str] = []
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start.wait()
        for i in range(60):
            rows = 8 * (1 + (seed + i) % 8)  # 8..64 rows: every call its own sizes
            a, w = torch.randn(rows, 32, generator=gen), torch.randn(32, 16, generator=gen)
            b = torch.randn(rows, 16, generator=gen)
            try:
                (out,) = fd.execute([a, w, b], number_of_streams=1 + i % 3)
                torch.testing.assert_close(out, a @ w + b)
            except Exception as err:  # any failure, reported with its thread
                failures.append(f"thread {seed} call {i}: {type(err).__name__}: {err}")
                return

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, "\n".join(failures[:3])
    assert fd.executor.num_programs == 1


def test_threads_writing_preallocated_outputs():
    fd = _stream_matmul_add()
    failures: list[str] = []

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(100 + seed)
        for i in range(30):
            a, w, b = torch.randn(16, 8, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(16, 4, generator=gen)
            out = torch.full((16, 4), float("nan"))
            fd.execute([a, w, b], outputs=[out])
            if not torch.allclose(out, a @ w + b, atol=1e-5, rtol=1e-5):
                failures.append(f"thread {seed} call {i}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


# ---------------------------------------------------------------- aliasing


def _two_outputs():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(x, 2.0))
        fd.add_output(fd.ops.add(x, 1.0))
    return fd


def test_the_same_buffer_as_two_outputs_is_an_error_naming_both():
    buf = torch.empty(4, 3)
    with pytest.raises(InputError, match=r"preallocated output 1 \(T\d+\) shares memory with preallocated output 0"):
        _two_outputs().execute([torch.randn(4, 3)], outputs=[buf, buf])


def test_overlapping_views_as_outputs_are_an_error():
    whole = torch.empty(5, 3)
    with pytest.raises(InputError, match=r"output 1 \(T\d+\) shares memory with preallocated output 0"):
        _two_outputs().execute([torch.randn(4, 3)], outputs=[whole[:4], whole[1:]])


def test_output_overlapping_an_input_view_is_an_error_naming_it():
    whole = torch.randn(8, 3)
    with pytest.raises(InputError, match=r"preallocated output 0 \(T\d+\) shares memory with input 0 \(T0\)"):
        _two_outputs().execute([whole[:4]], outputs=[whole[3:7], torch.empty(4, 3)])


def test_disjoint_views_of_one_buffer_are_accepted():
    whole = torch.full((8, 3), float("nan"))
    x = torch.randn(4, 3)
    first, second = _two_outputs().execute([x], outputs=[whole[:4], whole[4:]])
    torch.testing.assert_close(whole, torch.cat([x * 2, x + 1]))
    assert first.data_ptr() == whole.data_ptr()


# ---------------------------------------------------------------- errors


def _hostir_modules():
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="hostir."):
        yield importlib.import_module(info.name)


def test_every_error_class_derives_from_hostir_error():
    classes = {
        obj
        for module in _hostir_modules()
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__.startswith("hostir")
    }
    assert len(classes) >= 15, classes
    stray = sorted(c.__qualname__ for c in classes if not issubclass(c, HostIrError))
    assert not stray, f"error classes not derived from HostIrError: {stray}"


_BUILTIN_ERRORS = {name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)}


def test_hostir_raises_no_builtin_exception_class():
    """Every `raise X(...)` in the package names a hostir class (a bare
    `raise` re-raising a caught error is fine)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id in _BUILTIN_ERRORS:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: raise {target.id}")
    assert not found, "\n".join(found)


def test_torch_error_inside_an_op_keeps_its_type_and_gains_the_dump_line(monkeypatch):
    with FusionDefinition() as fd:
        a, w = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1])
        out = fd.ops.matmul(a, w)
        fd.add_output(out)
    out.axis(0).parallelize(ParallelType.stream)  # one matmul per row, in a loop

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    # torch.matmul replaced from Python reaches the Python evaluator only
    # (test_flat_program.py checks that both evaluators report torch's
    # errors alike).
    monkeypatch.setattr(torch, "matmul", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as info:
        fd.execute([torch.randn(4, 2), torch.randn(2, 3)], number_of_streams=2, evaluator="python")
    assert str(info.value) == "CUDA out of memory. Tried to allocate 2.00 GiB"
    (note,) = info.value.__notes__  # one note, though the op sits in a loop
    assert note.startswith("While executing:\n"), note
    assert "= matmul( T" in note, note
    assert note.endswith("in loop StreamIdx = 0"), note


def test_bad_input_is_a_hostir_error_and_a_value_error():
    with pytest.raises(HostIrError) as info:
        _two_outputs().execute([torch.randn(4, 3, 2)])
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------- dump options


def test_unknown_nvfuser_dump_option_is_ignored_with_one_warning(monkeypatch, capsys):
    monkeypatch.setenv("NVFUSER_DUMP", "cuda_kernel,host_ir,python_definition")
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"NVFUSER_DUMP=.*ignores 'cuda_kernel', 'python_definition'"):
        (out,) = _two_outputs().execute([x])[:1]
    torch.testing.assert_close(out, x * 2)
    assert "%HostIrContainer {" in capsys.readouterr().out  # host_ir still counts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _two_outputs().execute([x])  # the same setting warns once


def test_unknown_hostir_dump_option_stays_an_error(monkeypatch):
    monkeypatch.setenv("HOSTIR_DUMP", "cuda_kernel")
    with pytest.raises(hostir.OptionError, match="HOSTIR_DUMP: unknown option 'cuda_kernel'"):
        _two_outputs().execute([torch.randn(2, 2)])


# ---------------------------------------------------------------- devices


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_inputs_of_a_gpu_program_are_copied_with_one_warning():
    fd = _stream_matmul_add()
    a, w, b = torch.randn(8, 4, device="cuda"), torch.randn(4, 3), torch.randn(8, 3)
    with pytest.warns(UserWarning, match=r"inputs 1 \(T1\), 2 \(T2\) are on the CPU .* runs on cuda:0: copied there \(144 bytes"):
        (out,) = fd.execute([a, w, b])
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, a @ w.cuda() + b.cuda())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (out,) = fd.execute([torch.randn(8, 4), w, b], device="cuda")
    assert out.device.type == "cuda"


# ---------------------------------------------------------------- sharded outputs


def test_preallocated_output_on_a_sharded_symbolic_axis_gets_the_shape_check():
    """A preallocated output whose symbolic axis is split by a mesh_x
    piece: its expected size is the whole size over the mesh's size along
    that piece (8 rows over 2 ranks: 4), and a wrong one is an InputError
    naming both shapes."""
    from hostir.runtime.checks import check_outputs, check_sizes, equal_input_axes

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.relu(x)
        fd.add_output(y)
    mesh = hostir.DeviceMesh([0, 1])
    for tv in (x, y):
        tv.set_device_mesh(mesh)
        tv.outer_split(0, 2)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    piece = torch.randn(4, 3)
    sizes = check_sizes(fd.fusion, [piece], equal_input_axes(fd.fusion))
    check_outputs(fd.fusion, [torch.empty(4, 3)], [piece], sizes, piece.device)
    with pytest.raises(InputError, match=r"preallocated output 0 \(T\d+\): expected shape \[4, 3\], got \[8, 3\]"):
        check_outputs(fd.fusion, [torch.empty(8, 3)], [piece], sizes, piece.device)


@pytest.mark.parametrize("where", ["argument", "environment"])
def test_a_schedule_typo_is_an_error_where_nothing_would_read_it(where, monkeypatch):
    # A single-device fusion walks no device axis: its schedule is never
    # used, yet a typo in it is an error, not silently ignored.
    from hostir.errors import ScheduleError

    fd = _stream_matmul_add()
    inputs = [torch.randn(8, 4), torch.randn(4, 3), torch.randn(8, 3)]
    kwargs = {}
    if where == "argument":
        kwargs["schedule"] = "rnig:chunks=2"
    else:
        monkeypatch.setenv("HOSTIR_SCHEDULE", "ring:chunks=two")
    with pytest.raises(ScheduleError, match="HOSTIR_SCHEDULE=|schedule=") as err:
        fd.execute(inputs, **kwargs)
    assert ("rnig" if where == "argument" else "two") in str(err.value)
    monkeypatch.delenv("HOSTIR_SCHEDULE", raising=False)
    (out,) = fd.execute(inputs, schedule="ring:chunks=2")
    torch.testing.assert_close(out, inputs[0] @ inputs[1] + inputs[2])


def test_a_timeout_typo_is_an_error_where_nothing_would_read_it(monkeypatch):
    from hostir.communicator import CommunicatorArgumentError

    fd = _stream_matmul_add()
    monkeypatch.setenv("HOSTIR_TIMEOUT", "30s")
    with pytest.raises(CommunicatorArgumentError, match="HOSTIR_TIMEOUT='30s' is not a number of seconds"):
        fd.execute([torch.randn(8, 4), torch.randn(4, 3), torch.randn(8, 3)])
