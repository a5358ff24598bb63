"""The `hostir` logger: lowering, cache hits and misses, the evaluator
chosen, each record prefixed with the rank."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import torch

from hostir import FusionDefinition, ParallelType

REPO = pathlib.Path(__file__).resolve().parents[2]


def _fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.add(x, x)
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def test_lowering_and_cache_are_logged_with_the_rank(caplog):
    fd = _fusion()
    x = torch.randn(4, 3)
    with caplog.at_level(logging.DEBUG, logger="hostir"):
        (out,) = fd.execute([x])
        fd.execute([x])
    torch.testing.assert_close(out, x + x)
    messages = [r.getMessage() for r in caplog.records if r.name == "hostir"]
    assert all(m.startswith("[rank 0/1] ") for m in messages), messages
    assert sum("program cache miss for inputs (float32/2d)" in m for m in messages) == 1, messages
    assert sum("program cache hit for inputs (float32/2d)" in m for m in messages) == 1, messages
    (lowered,) = [m for m in messages if "lowered fusion" in m]
    assert "evaluator HostIrEvaluator on cpu with NullStreams" in lowered
    levels = {r.getMessage().split("] ", 1)[1].split()[1]: r.levelno for r in caplog.records if r.name == "hostir"}
    assert levels["fusion"] == logging.INFO and levels["cache"] == logging.DEBUG


def test_nothing_is_logged_by_default():
    code = "import sys; sys.path.insert(0, 'tests/python'); import test_logging, torch; test_logging._fusion().execute([torch.ones(2, 2)])"
    env = {k: v for k, v in os.environ.items() if k != "HOSTIR_LOG"}
    env["PYTHONPATH"] = str(REPO / "python")
    quiet = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "[rank 0/1]" not in quiet.stderr, quiet.stderr
    env["HOSTIR_LOG"] = "debug"
    loud = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "hostir DEBUG [rank 0/1] program cache miss" in loud.stderr, loud.stderr
