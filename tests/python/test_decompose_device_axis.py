"""Golden dumps of `decompose_device_axis`: the canonical overlapped programs
(hostir.overlap) lowered by each decomposition, chunk count, direction and
transport; bad meshes, chunk counts and schedules rejected with clear
errors; the schedule's choice from a machine model. Lowering needs no
process group: these run in one process. The numbers are checked against
eager torch under mpirun (tests/python/multidevice/test_decompositions.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hostir import ir, machine, overlap, planner
from hostir.lower import LoweringError, lower
from hostir.lower.schedule import Schedule, ScheduleError, parse

from conftest import check_golden


def _dump(fd, sched, rank=0, backend="gloo") -> str:
    return str(_program(fd, sched, rank, backend).program)


def _program(fd, sched, rank=0, backend="gloo"):
    return lower(fd.fusion, rank=rank, backend=backend, schedule=sched)


AG_CASES = {
    "ag_ring": Schedule(),
    "ag_ring_chunks2_reverse": Schedule("ring", chunks=2, direction=-1),
    "ag_ring_cuda": Schedule("ring", transport="cuda"),
    "ag_collective": Schedule("collective"),
    "ag_collective_chunks2": Schedule("collective", chunks=2),
    "ag_sequential": Schedule("sequential", note="a ring would take 0.002 ms against 0.001 ms sequentially"),
}
RS_CASES = {
    "rs_ring": Schedule(),
    "rs_ring_chunks2_cuda": Schedule("ring", chunks=2, transport="cuda"),
    "rs_collective": Schedule("collective"),
    "rs_sequential": Schedule("sequential"),
}


@pytest.mark.parametrize("name", list(AG_CASES))
def test_allgather_matmul_decomposition(name):
    check_golden(f"decompose_{name}", _program(overlap.allgather_matmul(2), AG_CASES[name]))


@pytest.mark.parametrize("name", list(RS_CASES))
def test_matmul_reduce_scatter_decomposition(name):
    check_golden(f"decompose_{name}", _program(overlap.matmul_reduce_scatter(2), RS_CASES[name]))


# One pass at a time: right after `decompose_device_axis` the loop of steps
# is marked to run on worker streams (a ring's own chunk before it counted
# as the caller's); right after `assign_streams` the caller/worker pattern
# is written, in the form asked for.
PASS_CASES = {
    "ag_ring": (overlap.allgather_matmul, Schedule()),
    "ag_collective": (overlap.allgather_matmul, Schedule("collective")),
    "rs_ring": (overlap.matmul_reduce_scatter, Schedule()),
    "rs_collective": (overlap.matmul_reduce_scatter, Schedule("collective")),
}


@pytest.mark.parametrize("name", list(PASS_CASES))
def test_decomposition_builds_only_loops(name):
    make, sched = PASS_CASES[name]
    lowered = lower(make(2).fusion, rank=0, backend="gloo", schedule=sched, until="decompose_device_axis")
    check_golden(f"decompose_loops_{name}", lowered)
    text = str(lowered.program)
    assert "CurrentStream" not in text and "Synchronize" not in text, text
    assert text.count("on worker streams") == 1, text


@pytest.mark.parametrize("form", ["pipelined", "per_iteration"])
# Not rs_collective: before the program is pruned for a rank, the race
# checker cannot tell which iteration's Reduce lands on this rank.
@pytest.mark.parametrize("name", ["ag_ring", "ag_collective", "rs_ring"])
def test_assigned_streams_of_a_decomposition(name, form):
    make, sched = PASS_CASES[name]
    lowered = lower(make(2).fusion, rank=0, backend="gloo", schedule=sched, until="assign_streams", stream_form=form)
    check_golden(f"assign_{name}" if form == "pipelined" else f"assign_{name}_{form}", lowered)
    assert "on worker streams" not in str(lowered.program)


def test_ring_own_chunk_runs_on_the_caller_between_the_two_loops():
    """The workers wait for the caller before the rank's own shard is
    computed, then the caller's stream is current again: the shard's matmul
    runs on it, beside the ring's steps, never queued before a step's push
    on the last worker."""
    program = lower(
        overlap.allgather_matmul(2).fusion, rank=0, backend="gloo", schedule=Schedule(), until="assign_streams"
    ).program
    kinds = [type(e).__name__ for e in program.exprs]
    # The rank's shard (a view of its input) feeds its GEMM in place.
    assert kinds == [
        "Allocate", "Allocate", "GetCurrentStream", "ForLoop", "SetCurrentStream",
        "HirAliasSelect", "HirAliasSelect", "MatmulOp", "ForLoop",
    ], kinds
    shard, matmul = program.exprs[5], program.exprs[7]
    assert matmul.a is shard.out and shard.input is program.inputs[0]
    assert [type(e).__name__ for e in program.exprs[3].body] == ["SetCurrentStream", "Synchronize"]
    caller = program.exprs[2].stream
    assert program.exprs[4].stream is caller


def test_reduce_ring_local_partial_runs_on_the_caller_while_the_partials_move():
    """The caller waits for each step's worker up to its first
    communication only (the peer's partial computed), then computes its
    own partial while the push goes on, then waits for every worker (the
    join) before the reduction reads the slots; the buffer of the partials
    sent is freed after the join, never while a push may read it."""
    program = lower(
        overlap.matmul_reduce_scatter(3).fusion, rank=1, backend="gloo", schedule=Schedule(),
        until="insert_deallocations",
    ).program
    exprs = program.exprs
    kinds = [type(e).__name__ for e in exprs]
    work = next(i for i, e in enumerate(exprs) if isinstance(e, ir.ForLoop) and e.schedule)
    join = next(i for i in range(work + 1, len(exprs)) if isinstance(exprs[i], ir.ForLoop))
    body = [type(e).__name__ for e in exprs[work].body]
    first_post = body.index("StartCoalescing")
    # In the step: compute, then the caller waits for it, then the posts.
    assert body[first_post - 3 : first_post] == ["SetCurrentStream", "Synchronize", "SetCurrentStream"], body
    assert "MatmulOp" in body[:first_post] and body[-1] == "SetCurrentStream", body
    # The local partial between the steps and the join; the join waits only.
    assert "MatmulOp" in kinds[work + 1 : join], kinds
    assert [type(e).__name__ for e in exprs[join].body] == ["Synchronize"]
    reduction = kinds.index("ReductionOp")
    assert join < reduction
    # Every buffer is freed after the join: the partials' buffer too, which
    # the pushes read until their workers are waited for.
    freed = [i for i, e in enumerate(exprs) if isinstance(e, ir.Deallocate)]
    assert freed and min(freed) > join, kinds


def test_ring_on_four_ranks_of_an_offset_mesh_names_positions():
    program = _program(overlap.allgather_matmul(4, first=2), Schedule(), rank=3)
    check_golden("decompose_ag_ring_mesh_2_to_5", program)
    dump = str(program.program)
    # This rank's position is rank - 2; peers go back to global ranks.
    assert "peer=( ( ( ( rank - 2 ) - StreamIdx ) % 4 ) + 2 )" in dump


def test_ring_steps_skip_the_local_shard():
    dump = _dump(overlap.allgather_matmul(3), Schedule(chunks=2))
    assert "FOR StreamIdx from 2 to 6 (ring, chunks=2, direction=+1, transport=gloo):" in dump
    # The local shard is read in place (the gathered tensor is not needed
    # whole afterwards), never copied into its slot, and sent once a step.
    assert "= Set( " not in dump and dump.count("type=send") == 1


def test_a_gathered_tensor_needed_whole_keeps_the_local_shard_in_its_slot():
    # Where the gathered tensor is an output too (a layer that keeps its
    # gathered input for the backward), every slot must hold its shard.
    from hostir import DeviceMesh, FusionDefinition, ParallelType

    D = 2
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1, -1])
        w = fd.define_tensor(shape=[-1, -1])
        xg = fd.ops.set(x)
        fd.add_output(fd.ops.matmul(xg, w))
        fd.add_output(xg)
    for tv in fd.fusion.inputs + fd.fusion.outputs:
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    for tv in fd.fusion.outputs:
        tv.axis(0).parallelize(ParallelType.stream)
    dump = _dump(fd, Schedule())
    assert "(ring, chunks=1" in dump and "= Set( " in dump, dump


def test_cuda_transport_allocates_symmetric_windows_and_names_where_sends_land():
    dump = _dump(overlap.allgather_matmul(2), Schedule(transport="cuda"))
    assert "mem_type=symmetric" in dump and "into=" in dump
    plain = _dump(overlap.allgather_matmul(2), Schedule())
    assert "mem_type=symmetric" not in plain and "into=" not in plain


def test_every_rank_lowers_the_same_program_before_pruning():
    digests = {lower(overlap.allgather_matmul(4).fusion, rank=r, schedule=Schedule(chunks=2)).digest for r in range(4)}
    assert len(digests) == 1


def test_mesh_of_non_consecutive_ranks_is_rejected():
    from hostir import DeviceMesh

    fd = overlap.allgather_matmul(2)
    for tv in fd.fusion.inputs + fd.fusion.outputs:
        tv.set_device_mesh(DeviceMesh([0, 2]))
    for e in fd.fusion.exprs:
        e.out.set_device_mesh(DeviceMesh([0, 2]))
    with pytest.raises(LoweringError, match=r"decompose_device_axis: .*1-D mesh of consecutive ranks"):
        lower(fd.fusion, rank=0, schedule=Schedule())


def test_constant_rows_that_do_not_split_into_chunks_are_rejected():
    from hostir import DeviceMesh, FusionDefinition, ParallelType

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, 3, 4])
        w = fd.define_tensor(shape=[4, 5])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(DeviceMesh([0, 1]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    with pytest.raises(LoweringError, match="extent 3 does not split into 2 chunks per peer"):
        lower(fd.fusion, rank=0, schedule=Schedule(chunks=2))


def test_symbolic_rows_record_their_chunk_check():
    lowered = lower(overlap.allgather_matmul(2).fusion, rank=0, schedule=Schedule(chunks=4))
    assert [(extent.label, parts) for extent, parts, _ in lowered.chunking] == [("i0", 4)]
    assert lowered.chunking[0].where.startswith("axis iS6{i0}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("spiral", "unknown decomposition 'spiral'"),
        ("ring:chunks=0", "chunks per peer must be an integer >= 1"),
        ("ring:chunks=two", "chunks must be an integer"),
        ("ring:direction=2", r"direction must be \+1 or -1"),
        ("ring:transport=mpi", "unknown transport 'mpi'"),
        ("ring:speed=fast", "unknown key 'speed'"),
        ("ring:chunks", "expected key=value"),
    ],
)
def test_bad_schedules_are_rejected(text, message):
    with pytest.raises(ScheduleError, match=message):
        parse(text)


def test_schedule_text_round_trips():
    assert parse("ring:chunks=2,direction=-1,transport=cuda") == Schedule("ring", 2, -1, "cuda")
    assert parse("sequential") == Schedule("sequential")


# ---------------------------------------------------------------- the model

H200ISH = machine.MachineModel("gpu", gemm_tflops=700.0, copy_gbps=370.0, collective_gbps=200.0, step_us=30.0)


def test_model_runs_small_shapes_sequentially():
    s = planner.choose(H200ISH, D=2, rows=16, k=256, n=256, itemsize=2, p2p=None, backend="NCCL")
    assert s.decomposition == "sequential" and "a ring would take" in s.note


def test_model_rings_large_shapes_over_the_copy_engine_with_chunks():
    s = planner.choose(H200ISH, D=2, rows=8192, k=8192, n=4096, itemsize=2, p2p=None, backend="NCCL")
    assert s.decomposition == "ring" and s.transport == "cuda" and s.chunks >= 1


def test_model_falls_back_to_the_programs_backend_without_p2p_and_says_why():
    s = planner.choose(H200ISH, D=2, rows=8192, k=8192, n=4096, itemsize=2, p2p="rank 1: no peer access", backend="NCCL")
    assert s.transport == "NCCL" and "no P2P: rank 1: no peer access" in s.note
    fd = overlap.allgather_matmul(2)
    assert "no P2P: rank 1: no peer access" in _dump(fd, s, backend="NCCL")


def test_model_never_picks_more_chunks_than_the_rows_divide_into():
    s = planner.choose(H200ISH, D=2, rows=8191, k=8192, n=4096, itemsize=2, p2p=None, backend="NCCL")
    assert s.chunks == 1


def test_machine_model_is_cached_per_device_name(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTIR_CACHE_DIR", str(tmp_path))
    assert machine.load_model("Some GPU") is None
    model = machine.MachineModel("Some GPU", 1.0, 2.0, 3.0, 4.0)
    path = machine.save_model(model)
    assert path.parent == tmp_path and machine.load_model("Some GPU") == model
    # The first writer wins: a rank that measured later reads the same model.
    machine.save_model(machine.MachineModel("Some GPU", 9.0, 9.0, 9.0, 9.0))
    assert machine.load_model("Some GPU") == model
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# Figures of the 2×H100 machine (device-only GEMM, NVLink push, NCCL bus).
H100ISH = machine.MachineModel(
    "gpu", gemm_tflops=730.0, copy_gbps=370.0, collective_gbps=150.0, step_us=10.0,
    gemm_slowdown_copy=1.04, gemm_slowdown_collective=1.12, host_ms=machine.HOST_MS,
)


def _PYTHON(transport: str, chunks: int) -> str:
    # Every candidate on the Python evaluator.
    return "python"


def test_the_model_never_rings_where_the_host_would_starve_the_gpu():
    # Eager on the Python evaluator, a shard of 1024 rows: each step costs
    # the host four times its GEMM.
    s = planner.choose(H100ISH, D=2, rows=1024, k=8192, n=4096, itemsize=2, p2p=None, backend="NCCL",
                       runs_on=_PYTHON)
    assert s.decomposition == "sequential", s.note


def test_a_replayed_call_rings_where_an_eager_python_one_would_not():
    eager = planner.choose(H100ISH, D=2, rows=1024, k=8192, n=4096, itemsize=2, p2p=None, backend="NCCL",
                           runs_on=_PYTHON)
    replayed = planner.choose(H100ISH, D=2, rows=1024, k=8192, n=4096, itemsize=2, p2p=None, backend="NCCL",
                              runs_on=_PYTHON, replay=True)
    assert eager.decomposition == "sequential"
    assert replayed.decomposition == "ring" and replayed.transport == "cuda", replayed.note
    assert "replayed" in replayed.note and "eager" in eager.note


def test_the_models_note_names_every_candidates_prediction():
    s = planner.choose(H100ISH, D=2, rows=8192, k=8192, n=4096, itemsize=2, p2p=None, backend="NCCL")
    assert s.decomposition == "ring"
    for candidate in ("sequential", "ring c=1 cuda", "ring c=2 cuda", "ring c=4 cuda", "ring c=1 NCCL"):
        assert candidate in s.note, s.note
    # The choice is the least of the predictions it lists.
    listed = s.note.split("ms: ", 1)[1].rstrip(")")
    times = {name.rsplit(" ", 1)[0]: float(name.rsplit(" ", 1)[1]) for name in listed.split(", ")}
    chosen = f"ring c={s.chunks} {s.transport}"
    assert times[chosen] == min(times.values()), s.note


def test_the_prediction_follows_the_device_then_the_host():
    # Replayed: the device's time. Eager: the runner's host time per call,
    # then the device's time where the GEMMs outlast the host's steps (a
    # big shard), else the host's steps and the last GEMM (a small one).
    call, step = H100ISH.host("python")
    for rows in (8192, 512):
        args = dict(D=2, rows=rows, k=8192, n=4096, itemsize=2, kind="ring", chunks=1, transport="cuda")
        replayed = machine.predict_ms(H100ISH, runner="python", replay=True, **args)
        python = machine.predict_ms(H100ISH, runner="python", **args)
        gemm = H100ISH.gemm_ms(2.0 * rows * 8192 * 4096)
        assert replayed == pytest.approx(2 * gemm * 1.04 + 0.01)
        assert python == pytest.approx(call + max(replayed, step + gemm * 1.04))
        assert (python - call > replayed) == (rows == 512)


def test_the_reduce_rings_sum_over_its_slots_costs_unless_the_gemm_adds_the_peers_partial():
    # The 2-GPU matmul+RS: 8192 rows a peer, N 8192, K 4096 a rank.
    args = dict(D=2, rows=8192, k=8192, n=4096, itemsize=2, kind="ring", transport="cuda", replay=True)
    summed = H100ISH.local_ms(3 * 8192 * 8192 * 2)
    assert 0.2 < summed < 0.4  # 0.27 ms measured on 2 x H100
    one = machine.predict_ms(H100ISH, chunks=1, **args)
    assert machine.predict_ms(H100ISH, chunks=1, reduce=True, **args) == pytest.approx(one + summed)
    for chunks in (2, 4):
        assert machine.fuses_reduction(2, chunks)
        gather = machine.predict_ms(H100ISH, chunks=chunks, **args)
        assert machine.predict_ms(H100ISH, chunks=chunks, reduce=True, **args) == gather
    # At 4 ranks every chunking sums its 4 slots.
    four = dict(args, D=4)
    assert not machine.fuses_reduction(4, 2)
    assert machine.predict_ms(H100ISH, chunks=2, reduce=True, **four) == pytest.approx(
        machine.predict_ms(H100ISH, chunks=2, **four) + H100ISH.local_ms(5 * 8192 * 8192 * 2)
    )
    # So the planner takes a chunked ring for the reduce side at 2 ranks,
    # whose program adds the partial in the GEMM, eager and replayed.
    for replay in (False, True):
        s = planner.choose(H100ISH, D=2, rows=8192, k=8192, n=4096, itemsize=2, p2p=None, backend="NCCL",
                           replay=replay, side="reduce")
        assert s.decomposition == "ring" and s.chunks > 1 and s.transport == "cuda", s.note
        program = str(_program(overlap.matmul_reduce_scatter(2), s, backend="NCCL").program)
        assert "sum in the local GEMM" in program and "accumulate = true" in program, program
    # A sequence-parallel product's slots are summed at every chunking.
    assert machine.predict_ms(H100ISH, chunks=2, reduce=True, fusable=False, **args) == pytest.approx(
        machine.predict_ms(H100ISH, chunks=2, **args) + summed
    )


def test_the_planner_plans_matmul_reduce_scatter_as_the_reduce_side_moving_n_wide_partials():
    # M = 16 rows (8 a rank), K = 8 (4 a rank), N = 6: each step moves 8 x 6 partials.
    fd = overlap.matmul_reduce_scatter(2)
    inputs, _ = overlap.matmul_reduce_scatter_inputs(torch.zeros(16, 8), torch.zeros(8, 6), 2, 0)
    assert planner._reduce_hint(fd.fusion, inputs, 2) is None
    assert planner._sums_over_ranks(fd.fusion)
    assert planner._gather_hint(fd.fusion, inputs, 2) == (8, 4, 6, 4)
    assert not planner._sums_over_ranks(overlap.allgather_matmul(2).fusion)


@pytest.mark.parametrize("schedule", [
    Schedule("sequential"), Schedule("ring", 1, 1, "gloo"), Schedule("ring", 2, 1, "gloo"),
    Schedule("ring", 1, 1, "cuda"), Schedule("ring", 2, 1, "cuda"),
])
def test_the_runner_the_model_predicts_is_the_one_the_program_gets(schedule):
    # The model's table of what the C++ executor runs, held against the
    # flat compiler's own reasons for refusing a program.
    from hostir.runtime import flat

    program = lower(overlap.allgather_matmul(2).fusion, rank=0, backend="gloo", schedule=schedule).program
    runs_in_cpp = not list(flat.unsupported_reasons(program))
    transport = schedule.transport or "gloo"
    assert (planner.runner_of("cpp", transport, schedule.chunks) == "cpp") is runs_in_cpp


def test_a_model_travels_between_ranks_as_words():
    back = machine.CPU_MODEL.from_words(H100ISH.to_words())
    assert back.device == "cpu" and back.gemm_tflops == H100ISH.gemm_tflops
    assert back.host_ms == H100ISH.host_ms and back.gemm_slowdown_copy == 1.04


def test_the_models_cache_key_names_torch_cuda_and_the_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTIR_CACHE_DIR", str(tmp_path))
    path = machine.save_model(H100ISH)
    assert torch.__version__.replace(".", "_").replace("+", "_") in path.name and path.name.endswith(".v3.json")
    assert machine.load_model("gpu") == H100ISH
    # A re-measurement replaces it; a rank that measured later does not.
    remeasured = dataclasses.replace(H100ISH, gemm_tflops=700.0)
    machine.save_model(remeasured)
    assert machine.load_model("gpu") == H100ISH
    machine.save_model(remeasured, replace=True)
    assert machine.load_model("gpu") == remeasured


def test_cpu_ranks_use_the_cpu_model():
    assert machine.machine_model(torch.device("cpu")) is machine.CPU_MODEL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measuring_the_gpu_leaves_the_callers_random_stream_alone(tmp_path, monkeypatch):
    # Only the rank that measures draws its operands: from the global
    # stream, ranks seeded alike would then draw different numbers after
    # the first multi-device call.
    monkeypatch.setenv("HOSTIR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(7)
    state = torch.cuda.get_rng_state()
    machine.measure(torch.device("cuda", 0))
    assert torch.equal(torch.cuda.get_rng_state(), state)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_model_is_timed_on_the_device(tmp_path, monkeypatch):
    # A GEMM timed without host gaps runs near the chip's rate: far above
    # the ~100 TFLOP/s that launches timed from Python showed on an H100.
    monkeypatch.setenv("HOSTIR_CACHE_DIR", str(tmp_path))
    model = machine.measure(torch.device("cuda", 0))
    assert model.gemm_tflops > 200.0, model
    assert model.copy_source in ("peer", "estimate") and model.copy_gbps > 10.0, model
    assert model.host_ms == machine.HOST_MS and model.step_us == machine.STEP_US
