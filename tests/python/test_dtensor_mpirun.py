"""A program that initializes torch.distributed itself, then runs hostir on
DTensors with a trace, under `mpirun -np 2` (gloo): hostir reuses the
default group, the result matches DTensor's own redistribute, and each rank
writes a trace whose stream tracks hold the chunks' Allgathers and matmuls."""

from __future__ import annotations

import json
import re
import sys

import pytest

from hostir.runtime.profiling import trace_path
from spawn import free_port
from launchers import run_job
from test_multidevice_mpirun import mpirun_command, requires_mpirun

SCRIPT = "tests/python/scripts/dtensor_user_init.py"


@requires_mpirun
@pytest.mark.timeout(200)
def test_dtensor_after_user_init_and_traces(tmp_path):
    program = [sys.executable, SCRIPT, str(free_port()), str(tmp_path)]
    exports = {"HOSTIR_TIMEOUT": "30", "HOSTIR_MASTER_PORT": str(free_port())}
    returncode, output, _ = run_job(mpirun_command(2, program, exports), 180)
    assert returncode == 0, output[-6000:]
    for rank in range(2):
        assert f"rank {rank}: DTensor result matches" in output, output[-6000:]
        trace = json.loads(trace_path(tmp_path, rank).read_text())
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert {"caller stream", "stream 0", "stream 1"} <= tracks, tracks
        assert all(e["pid"] == rank for e in events)
        comms = [e for e in events if re.fullmatch(r"Communication \d+ \(Allgather\)", e["name"])]
        matmuls = [e for e in events if re.fullmatch(r"matmul T\d+", e["name"])]
        # One Allgather and one matmul per chunk (4 chunks, 2 streams).
        assert len(comms) == 4 and len(matmuls) == 4, [e["name"] for e in events]
        assert {e["args"]["kind"] for e in comms} == {"communication"}
        assert {e["args"]["kind"] for e in matmuls} == {"compute"}
