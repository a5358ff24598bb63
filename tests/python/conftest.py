"""Shared fixtures: the device a test runs on, golden dumps, dump renumbering."""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch
import torch.distributed as dist

from hostir import communicator

GOLDEN = pathlib.Path(__file__).parent / "golden"

_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=_DEVICES)
def device(request) -> str:
    """Runs the test on the CPU and, where there is one, on a CUDA device."""
    torch.manual_seed(0)
    return request.param


def pytest_collection_modifyitems(config, items):
    """A test that takes `cuda_device` is a `cuda` test (`-m cuda` picks it)."""
    for item in items:
        if "cuda_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture
def cuda_device() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "cuda"


def check_golden(name: str, program) -> None:
    """Compare `program` (what `lower` returns, a HostIrContainer, or its
    dump) with tests/python/golden/<name>.hir; HOSTIR_ACCEPT=1 writes the
    file instead. A program is also checked for stream races (as the rank
    it was pruned for, if it was), and so is every mutant of it that lacks
    one of its Synchronize or Wait ops (each must race, or be a provably
    harmless removal)."""
    from hostir.container import HostIrContainer
    from hostir.lower import LoweredProgram
    from race_mutations import check_sync_mutations

    rank = None
    if isinstance(program, LoweredProgram):
        program, rank = program.program, program.rank
    text = str(program)
    if isinstance(program, HostIrContainer):
        check_sync_mutations(program, rank)
    path = GOLDEN / f"{name}.hir"
    if os.environ.get("HOSTIR_ACCEPT") == "1":
        path.write_text(text)
        return
    assert path.exists(), f"no golden dump {path}; run with HOSTIR_ACCEPT=1 to create it"
    assert text == path.read_text(), f"dump differs from {path}:\n{text}"


_PATTERNS = [
    ("T", re.compile(r"\bT(\d+)(?=_)")),
    ("id", re.compile(r"(?<=[irb])(?:S|StreamIdx|deviceIdx\.[xy])(\d+)(?=\{)")),
    ("i", re.compile(r"\bi(\d+)\b")),
    ("stream", re.compile(r"(?<=Stream )(\d+)")),
]


def renumber(text: str) -> str:
    """Number values of each kind 0, 1, 2... in order of first appearance, so
    two dumps that differ only in numbering compare equal."""
    for kind, pattern in _PATTERNS:
        seen: dict[str, int] = {}

        def sub(m: re.Match) -> str:
            n = seen.setdefault(m.group(1), len(seen))
            return m.group(0)[: m.start(1) - m.start(0)] + str(n) + m.group(0)[m.end(1) - m.start(0) :]

        text = pattern.sub(sub, text)
    return text


def _cpp_param():
    """The C++ evaluator's parameter: a missing extension fails the test
    (CI builds it) unless HOSTIR_NO_EXTENSION=1 says it was not built."""
    from hostir import cpp

    marks = []
    if not cpp.available() and os.environ.get("HOSTIR_NO_EXTENSION") == "1":
        marks.append(pytest.mark.skip(reason=f"hostir._C is not built: {cpp.reason()}"))
    return pytest.param("cpp", id="cpp", marks=marks)


@pytest.fixture(params=[pytest.param("python", id="python"), _cpp_param()])
def evaluator(request, monkeypatch) -> str:
    """Runs the test on each evaluator: `fd.execute` picks it through
    HOSTIR_EVALUATOR; hand-built containers use `evaluator_class`."""
    monkeypatch.setenv("HOSTIR_EVALUATOR", request.param)
    return request.param


@pytest.fixture
def evaluator_class(evaluator):
    from hostir import cpp
    from hostir.runtime.evaluator import HostIrEvaluator

    return cpp.CppEvaluator if evaluator == "cpp" else HostIrEvaluator


@pytest.fixture
def plain_process(monkeypatch):
    """One plain process: no launcher variables, and no communicator or
    process group left behind."""
    for name in (*communicator.LAUNCHER_VARIABLES, "HOSTIR_TIMEOUT", "HOSTIR_MASTER_ADDR", "HOSTIR_MASTER_PORT",
                 "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    communicator.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
