"""The backends are declared once (`hostir.backends`): every layer's view of
them is read from that table, and the table says what the C++ executor
really runs."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

import hostir.cpp
from hostir import backends, ir, planner
from hostir.lower import schedule
from hostir.runtime import flat, transports
from hostir.runtime.transports import torch_dist


def test_every_layer_reads_the_one_table():
    assert ir.BACKENDS is backends.NAMES and schedule.TRANSPORTS is backends.NAMES
    assert ir.backend_name is backends.backend_name
    assert set(torch_dist.BACKENDS) == {b.name for b in backends.BACKENDS.values() if b.process_group}
    for b in backends.BACKENDS.values():
        assert transports.capabilities(b.name) is b.capabilities
        assert planner.runner_of("cpp", b.name, 1) == ("cpp" if b.cpp else "python")


@pytest.mark.skipif(not hostir.cpp.available(), reason="the C++ executor is not built")
def test_the_table_says_what_the_cpp_executor_runs():
    from hostir import _C

    assert set(_C.TRANSPORTS) == {b.name for b in backends.BACKENDS.values() if b.cpp}


def test_a_communicators_backend_names_the_programs_backend():
    assert backends.of_process_group("nccl").name == "NCCL"
    assert backends.of_process_group("gloo").name == "gloo"
    with pytest.raises(hostir.DefinitionError, match="no backend runs process groups of 'mpi'"):
        backends.of_process_group("mpi")


def test_spellings_are_checked_against_the_table():
    assert backends.get("nccl").name == "NCCL" and backends.get(" CUDA ").name == "cuda"
    with pytest.raises(hostir.DefinitionError, match="unknown backend 'ucc'; expected one of NCCL, gloo, cuda"):
        backends.get("ucc")
    with pytest.raises(hostir.errors.ScheduleError, match="unknown transport 'ucc'"):
        schedule.parse("ring:transport=ucc")


def test_the_flat_compiler_sends_a_backend_the_table_marks_python_only_to_python(monkeypatch):
    # The table alone decides: the copy-engine transport runs in C++, and
    # marked Python-only its program runs on the Python evaluator, saying why.
    from hostir import overlap
    from hostir.lower import lower
    from hostir.lower.schedule import Schedule

    program = lower(
        overlap.allgather_matmul(2).fusion, rank=0, backend="gloo", schedule=Schedule(transport="cuda")
    ).program
    assert list(flat.unsupported_reasons(program)) == []
    monkeypatch.setitem(backends.BACKENDS, "cuda", dataclasses.replace(backends.BACKENDS["cuda"], cpp=False))
    reasons = list(flat.unsupported_reasons(program))
    assert any("the cuda transport runs in Python" in r for r in reasons), reasons


class _Frame:
    """A frame as `transports.transport_for` reads it: a communicator that
    carries no transport of its own."""

    communicator = None


def test_a_backends_transport_is_found_through_the_module_its_entry_names():
    for b in backends.BACKENDS.values():
        module = importlib.import_module(f"hostir.runtime.transports.{b.module}")
        assert callable(getattr(module, transports.ENTRY_POINT)), b
    for name in ("NCCL", "gloo"):
        found = transports.transport_for(_Frame(), name.lower())
        assert isinstance(found, torch_dist.TorchDistTransport) and found.name == name
        assert found is transports.transport_for(_Frame(), name)


def test_a_backend_whose_module_has_no_entry_point_is_refused(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "gloo", dataclasses.replace(backends.BACKENDS["gloo"], module="host"))
    with pytest.raises(
        transports.TransportUsageError,
        match=r"the backend 'gloo' names the transport module hostir\.runtime\.transports\.host, "
        r"which has no for_frame\(frame, backend\)",
    ):
        transports.transport_for(_Frame(), "gloo")


def test_a_backend_whose_module_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "gloo", dataclasses.replace(backends.BACKENDS["gloo"], module="ucc"))
    with pytest.raises(
        transports.TransportUsageError,
        match=r"the backend 'gloo' names the transport module hostir\.runtime\.transports\.ucc, which does not exist",
    ):
        transports.transport_for(_Frame(), "gloo")
