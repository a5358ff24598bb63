"""Profiler ranges, per-rank traces and the timeline plot of host programs."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import hostir
import hostir.cpp
from hostir import DeviceMesh, FusionDefinition, ParallelType, timeline
from hostir.runtime import profiling
from hostir.lower import lower

REPO = pathlib.Path(__file__).resolve().parents[2]


def stream_matmul():
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        c = fd.ops.matmul(a, b)
        fd.add_output(fd.ops.add(c, a))
    for tv in fd.fusion.outputs + [c]:
        tv.axis(0).parallelize(ParallelType.stream)
    return fd


def inputs():
    return [torch.randn(8, 8), torch.randn(8, 8)]


def test_ops_are_profiler_ranges_named_by_opcode():
    fd = stream_matmul()
    a, b = inputs()
    with torch.profiler.profile() as prof:
        (out,) = fd.execute([a, b], number_of_streams=2)
    torch.testing.assert_close(out, a @ b + a)
    names = {e.key for e in prof.key_averages()}
    dump = fd.host_ir()
    for expected in ("FOR StreamIdx", "Synchronize Stream 0", "SetCurrentStream to Stream ( StreamIdx % numberOfStreams )"):
        assert expected in names, sorted(names)
    matmul = [n for n in names if n.startswith("matmul T")]
    add = [n for n in names if n.startswith("add T")]
    assert len(matmul) == 1 and len(add) == 1, sorted(names)
    # The number is the dump's: the op's output tensor.
    assert f"{matmul[0].split()[1]}_l_float" in dump or f"{matmul[0].split()[1]}_g_float" in dump


def test_nothing_observes_a_run_with_profiling_off(monkeypatch):
    monkeypatch.setenv("HOSTIR_EVALUATOR", "python")  # the evaluator whose hook this checks
    fd = stream_matmul()
    fd.execute(inputs())
    (program,) = fd.executor._programs.values()
    assert profiling.observer_for(program.container, program.evaluator.streams, 0) is None
    with torch.profiler.profile():
        assert profiling.observer_for(program.container, program.evaluator.streams, 0) is not None


def test_communications_are_named_with_their_number_and_type():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        fd.add_output(fd.ops.set(x))
    mesh = DeviceMesh([0, 1])
    x.set_device_mesh(mesh)
    fd.fusion.outputs[0].set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)
    container = lower(fd.fusion, rank=0, backend="gloo").program
    names = [profiling.op_name(e) for e in container.walk()]
    (comm,) = [n for n in names if n.startswith("Communication")]
    number = comm.split()[1]
    assert comm == f"Communication {number} (Allgather)"
    assert f"Communication {number} (type=Allgather" in str(container)
    assert f"Wait Communication {number}" in names


def test_trace_has_a_track_per_stream(tmp_path):
    fd = stream_matmul()
    a, b = inputs()
    (out,) = fd.execute([a, b], number_of_streams=2, trace=tmp_path)
    torch.testing.assert_close(out, a @ b + a)
    trace = json.loads(profiling.trace_path(tmp_path, 0).read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(tracks.values()) == {"caller stream", "stream 0", "stream 1"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in events:
        assert e["dur"] >= 0 and e["pid"] == 0 and e["args"]["kind"] in profiling.KINDS
    # 8 rows, one chunk per row: each chunk's matmul on stream i % 2.
    matmuls = [e for e in events if e["name"].startswith("matmul")]
    assert [tracks[e["tid"]] for e in matmuls] == ["stream 0", "stream 1"] * 4
    assert all(e["args"]["kind"] == "compute" for e in matmuls)
    syncs = {e["args"]["kind"] for e in events if e["name"].startswith("Synchronize")}
    assert syncs == {"sync"}
    # Ops on one track do not overlap (one host thread issues them).
    for tid in tracks:
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == tid)
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(mine, mine[1:]))


def _events(directory) -> list[tuple]:
    trace = json.loads(profiling.trace_path(directory, 0).read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    return [(e["name"], e["args"]["kind"], tracks[e["tid"]], e["args"].get("posted_to_wait", False)) for e in events]


@pytest.mark.skipif(not hostir.cpp.available(), reason="the C++ executor is not built")
def test_the_cpp_executor_traces_the_ops_the_python_evaluator_traces(tmp_path):
    # The same program on both runners: the same ops, kinds and tracks, in
    # the same order; each event of the C++ run says which runner made it.
    fd = stream_matmul()
    a, b = inputs()
    for evaluator in ("python", "cpp"):
        (out,) = fd.execute([a, b], number_of_streams=2, trace=tmp_path / evaluator, evaluator=evaluator)
        torch.testing.assert_close(out, a @ b + a)
        assert fd.executor.last_runner.name == evaluator
    python, cpp = _events(tmp_path / "python"), _events(tmp_path / "cpp")
    assert cpp == python and len(cpp) > 20
    trace = json.loads(profiling.trace_path(tmp_path / "cpp", 0).read_text())
    assert {e["args"]["runner"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"cpp"}


@pytest.mark.skipif(not hostir.cpp.available(), reason="the C++ executor is not built")
def test_a_cpp_trace_spans_each_communication_from_its_post_to_its_wait(tmp_path):
    # One rank, a transfer-free program with a communication: the team of
    # one keeps its input (no peer), still posted and waited for.
    from one_rank_linears import one_rank_linear

    fd = one_rank_linear("K")
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    traces = {}
    for evaluator in ("python", "cpp"):
        (y,) = fd.execute([x, w], trace=tmp_path / evaluator, evaluator=evaluator)
        torch.testing.assert_close(y, x @ w.T)
        traces[evaluator] = _events(tmp_path / evaluator)
    # The C++ program binds the communication's output as its own buffer
    # (no ALLOCATE instruction): host ops may differ, the device work not.
    device_work = {k: [e for e in v if e[1] != "host"] for k, v in traces.items()}
    assert device_work["cpp"] == device_work["python"]
    spans = [e for e in traces["cpp"] if e[3]]
    assert spans and all(e[1] == "communication" and e[0].startswith("Communication") for e in spans)


@pytest.mark.skipif(not hostir.cpp.available(), reason="the C++ executor is not built")
def test_the_cpp_executor_traces_a_gpu_run_from_events_on_its_streams(tmp_path, cuda_device):
    fd = stream_matmul()
    a, b = (t.to(cuda_device) for t in inputs())
    for evaluator in ("python", "cpp"):
        (out,) = fd.execute([a, b], number_of_streams=2, trace=tmp_path / evaluator, evaluator=evaluator)
        torch.testing.assert_close(out, a @ b + a)
    assert _events(tmp_path / "cpp") == _events(tmp_path / "python")
    trace = json.loads(profiling.trace_path(tmp_path / "cpp", 0).read_text())
    matmuls = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("matmul")]
    assert len(matmuls) == 8 and all(e["dur"] > 0 for e in matmuls)


def test_a_graph_replay_is_one_event_of_the_trace(tmp_path, cuda_device):
    fd = stream_matmul()
    a, b = (t.to(cuda_device) for t in inputs())
    fd.execute([a, b], number_of_streams=2, cuda_graph=True)  # captured here
    (out,) = fd.execute([a, b], number_of_streams=2, cuda_graph=True, trace=tmp_path)
    torch.testing.assert_close(out, a @ b + a)
    trace = json.loads(profiling.trace_path(tmp_path, 0).read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["CUDA graph replay"], events
    assert events[0]["args"]["runner"] == "cuda_graph" and "one launch" in events[0]["args"]["note"]
    assert events[0]["dur"] > 0


@pytest.mark.parametrize(
    "evaluator",
    ["python", pytest.param("cpp", marks=pytest.mark.skipif(not hostir.cpp.available(), reason="no C++ executor"))],
)
def test_a_parallel_linears_events_name_its_module(tmp_path, plain_process, monkeypatch, evaluator):
    # Every event of a hostir.parallel Linear's programs, forward and
    # backward, names the module as its dumps do; a plain fusion's name none.
    from compiled_blocks import HIDDEN, Block, parallel_block
    from one_rank_linears import MESH

    monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
    torch.manual_seed(0)
    model = parallel_block(Block(), MESH.to_torch("cpu"))
    x = torch.randn(4, HIDDEN, requires_grad=True)
    with profiling.tracing(tmp_path, 0):
        model(x).backward(torch.randn(4, HIDDEN))
        stream_matmul().execute(inputs())
    trace = json.loads(profiling.trace_path(tmp_path, 0).read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    programs = {e["args"].get("program") for e in events}
    assert programs == {
        f"({name}, {kind} nn.Linear) ({part})"
        for name, kind in (("up", "colwise"), ("down", "rowwise"))
        for part in ("training forward", "backward")
    } | {None}
    linear = [e for e in events if e["name"].startswith("linear")]
    assert {e["args"]["program"] for e in linear} == {
        "(up, colwise nn.Linear) (training forward)",
        "(down, rowwise nn.Linear) (training forward)",
    }
    assert {e["args"].get("runner", "python") for e in linear} == {evaluator}


def test_env_trace_written_at_exit(tmp_path):
    code = (
        "import torch, sys; sys.path.insert(0, 'tests/python');"
        "from test_profiling import stream_matmul, inputs;"
        "fd = stream_matmul(); fd.execute(inputs()); fd.execute(inputs())"
    )
    env = dict(os.environ, HOSTIR_TRACE=str(tmp_path), PYTHONPATH=str(REPO / "python"))
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)
    trace = json.loads(profiling.trace_path(tmp_path, 0).read_text())
    runs = {e["args"]["run"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert runs == {0, 1}
    table = timeline.rows([trace])
    assert [label for label, _ in table] == ["rank 0 caller stream", "rank 0 stream 0", "rank 0 stream 1", "rank 0 stream 2", "rank 0 stream 3"]
    assert all(e["args"]["run"] == 1 for _, events in table for e in events)
    assert min(e["ts"] for _, events in table for e in events) == 0


def test_plot_timeline_draws_a_png(tmp_path):
    fd = stream_matmul()
    fd.execute(inputs(), number_of_streams=2, trace=tmp_path)
    out = tmp_path / "timeline.png"
    result = subprocess.run(
        [sys.executable, "tools/plot_timeline.py", str(tmp_path), "-o", str(out)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO / "python")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_without_traces_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no hostir_trace_rank"):
        timeline.load(tmp_path)


