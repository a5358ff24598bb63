"""The hoisting pass: each transfer (and communication) is posted as early
as its operands, the memory budget and the lookahead allow, its Wait stays
before the first use, and the race checker proves every program it makes
right. Golden dumps, property tests over stacks of layers and budgets,
results against eager torch for every choice, forcing the choice, and the
machine model's choice per input signature."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hostir
from conftest import check_golden
from hostir import FusionDefinition, ir, machine
from hostir.lower import lower
from hostir.layout import constant_bytes
from hostir.lower.hoist_transfers import Hoisting, HoistingError, parse

H = 16
WEIGHT = H * H * 4


def mlp(layers: int, memory: str = "host"):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H])
        ws = [fd.define_tensor([H, H], memory=memory) for _ in range(layers)]
        y = x
        for w in ws:
            y = fd.ops.gelu(fd.ops.linear(y, w))
        fd.add_output(y)
    return fd


def reference(x, ws):
    for w in ws:
        x = torch.nn.functional.gelu(x @ w.T)
    return x


def live_weights(program) -> int:
    """The most constant-size device buffers live at once, in bytes."""
    live, peak, sizes = 0, 0, {}
    for e in program.exprs:
        if isinstance(e, ir.Allocate) and e.memory_type is not ir.MemoryType.host:
            sizes[e.buffer] = constant_bytes(e.buffer) or 0
            live += sizes[e.buffer]
            peak = max(peak, live)
        elif isinstance(e, ir.Deallocate):
            live -= sizes.pop(e.buffer, 0)
    return peak


def posts_ahead(program) -> list[int]:
    """For each transfer, how many compute ops lie between it and its Wait
    (0 for one on the current stream: it has none)."""
    found = []
    for i, e in enumerate(program.exprs):
        if isinstance(e, ir.Transfer) and not e.posted:
            found.append(0)
        elif isinstance(e, ir.Transfer):
            j = next(k for k, w in enumerate(program.exprs) if isinstance(w, ir.Wait) and w.communication is e)
            found.append(sum(isinstance(x, ir.FUSION_OPS) for x in program.exprs[i:j]))
    return found


@pytest.mark.parametrize(
    "name, hoisting",
    [("default", Hoisting()), ("sequential", Hoisting("sequential", note="forced")), ("lookahead_1", Hoisting(lookahead=1))],
)
def test_golden_dump(name, hoisting):
    check_golden(f"hoist_mlp_{name}", lower(mlp(3).fusion, hoisting=hoisting).program)


def test_next_layers_weights_move_while_this_layer_computes():
    program = lower(mlp(4).fusion).program
    # Layer 0's weights have nothing to hide under; each later layer's
    # transfer is posted before the previous layer's linear and gelu.
    assert posts_ahead(program)[0] == 0
    assert all(n >= 2 for n in posts_ahead(program)[1:]), posts_ahead(program)
    assert live_weights(program) == 2 * WEIGHT
    assert hostir.check_races(program) == []


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 6),
    budget=st.one_of(st.none(), st.integers(0, 5)),
    lookahead=st.one_of(st.none(), st.integers(0, 4)),
)
def test_any_budget_keeps_its_bound_and_no_races(layers, budget, lookahead):
    hoisting = Hoisting(budget_bytes=None if budget is None else budget * WEIGHT, lookahead=lookahead)
    program = lower(mlp(layers).fusion, hoisting=hoisting).program
    sequential = lower(mlp(layers).fusion, hoisting=Hoisting("sequential")).program
    bound = 2 * WEIGHT if budget is None else max(budget * WEIGHT, live_weights(sequential))
    assert live_weights(program) <= bound
    if lookahead is not None:
        assert all(n <= lookahead + 1 for n in posts_ahead(program))  # + the op that waits
    assert hostir.check_races(program) == []
    # The same ops run, in an order the dependences allow; a transfer that
    # overlaps nothing runs on the current stream, with no Wait.
    assert kinds(program) == kinds(sequential)
    for p in (program, sequential):
        waited = {id(e.communication) for e in p.exprs if isinstance(e, ir.Wait)}
        for i, e in enumerate(p.exprs):
            if isinstance(e, ir.Transfer):
                assert e.posted == (id(e) in waited)
                assert e.posted == (posts_ahead_of(p, i) > 0)


def kinds(program) -> list[str]:
    return sorted(type(e).__name__ for e in program.exprs if not isinstance(e, ir.Wait))


def posts_ahead_of(program, i: int) -> int:
    """The compute ops and posts between the transfer at `i` and its Wait
    (0 for one on the current stream)."""
    t = program.exprs[i]
    if not t.posted:
        return 0
    j = next(k for k, w in enumerate(program.exprs) if isinstance(w, ir.Wait) and w.communication is t)
    return sum(isinstance(x, ir.FUSION_OPS + ir.POSTED_OPS) for x in program.exprs[i + 1 : j])


@pytest.mark.parametrize("option", ["hoist", "sequential", "hoist:lookahead=1", "hoist:budget=1KiB", "auto"])
def test_every_choice_matches_eager_torch(option):
    torch.manual_seed(0)
    fd = mlp(4)
    x, ws = torch.randn(5, H), [torch.randn(H, H) for _ in range(4)]
    (out,) = fd.execute([x, *ws], hoist=option)
    torch.testing.assert_close(out, reference(x, ws))


def test_a_budget_of_one_weight_keeps_one_weight_on_the_device():
    program = lower(mlp(3).fusion, hoisting=parse("hoist:budget=1KiB")).program
    # Each layer's weights move only once the previous layer's are freed
    # (after its linear): under that layer's gelu alone.
    assert posts_ahead(program) == [0, 1, 1]
    assert live_weights(program) == WEIGHT


def test_the_choice_shows_in_the_dump_and_can_be_forced(monkeypatch, capsys):
    x, ws = torch.randn(2, H), [torch.randn(H, H) for _ in range(2)]
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    monkeypatch.setenv("HOSTIR_HOIST", "sequential")
    mlp(2).execute([x, *ws])
    assert "schedule=(sequential: forced)" in capsys.readouterr().out
    monkeypatch.setenv("HOSTIR_HOIST", "hoist")
    mlp(2).execute([x, *ws])
    assert "schedule=(hoisted above 2 compute ops; forced)" in capsys.readouterr().out
    # The execute option wins over the variable.
    mlp(2).execute([x, *ws], hoist="sequential")
    assert "schedule=(sequential: forced)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, error",
    [("eager", "hoisting mode must be one of"), ("hoist:depth=2", "expected budget="), ("hoist:budget=3XB", "unknown unit")],
)
def test_bad_hoisting_options_are_refused(text, error):
    with pytest.raises(HoistingError, match=error):
        parse(text)
    with pytest.raises(hostir.HostIrError, match=error):
        mlp(1).execute([torch.randn(2, H), torch.randn(H, H)], hoist=text)


def test_parse_reads_budgets_and_lookaheads():
    assert parse("hoist:budget=2GiB,lookahead=3") == Hoisting(budget_bytes=2 << 30, lookahead=3, note="forced")
    assert parse("sequential").mode == "sequential"


H100 = machine.MachineModel("H100", gemm_tflops=700.0, copy_gbps=0.0, collective_gbps=150.0, step_us=30.0,
                             h2d_gbps=51.7, d2h_gbps=50.0)


def _stack_times(model, m: int, layers: int = 6, h: int = 8192):
    copy = model.transfer_ms(h * h * 2)
    compute = model.gemm_ms(2.0 * m * h * h)
    return [copy] * layers, [compute] * layers


@pytest.mark.parametrize("m, expected", [
    # A few rows hide less compute than the hand-offs cost: sequential.
    (1, ("sequential", 1)),
    (512, ("sequential", 1)),
    # Chunks hide most of the first copy (compute bound) or the last
    # compute (copy bound).
    (2048, ("hoist", 4)),
    (8192, ("hoist", 4)),
    (16384, ("hoist", 4)),
])
def test_the_model_never_picks_a_schedule_it_thinks_slower(m, expected):
    transfers, computes = _stack_times(H100, m)
    mode, chunks, note = machine.choose_hoisting(H100, transfers, computes)
    handoff = machine.HANDOFF_US * 1e-3
    estimates = {
        ("sequential", 1): machine.pipeline_ms(transfers, computes, depth=1),
        ("hoist", 1): machine.pipeline_ms(transfers, computes, handoff_ms=handoff),
        ("hoist", 4): machine.pipeline_ms(transfers, computes, 4, step_ms=machine.PIECE_US * 1e-3,
                                          handoff_ms=handoff),
    }
    assert estimates[(mode, chunks)] == min(estimates.values()), note
    assert (mode, chunks) == expected, note


@pytest.mark.parametrize("m", [1, 512, 1024, 2048, 4096, 8192, 16384, 65536])
def test_the_model_hoists_only_for_a_gain_beyond_its_noise(m):
    transfers, computes = _stack_times(H100, m)
    mode, chunks, note = machine.choose_hoisting(H100, transfers, computes)
    sequential = machine.pipeline_ms(transfers, computes, depth=1)
    handoff = machine.HANDOFF_US * 1e-3
    hoisted = min(
        machine.pipeline_ms(transfers, computes, handoff_ms=handoff),
        machine.pipeline_ms(transfers, computes, 4, step_ms=machine.PIECE_US * 1e-3, handoff_ms=handoff),
    )
    gains = hoisted < sequential * (1 - machine.NOISE)
    assert mode == ("hoist" if gains else "sequential"), note
    if not gains and hoisted < sequential:
        assert f"hoisting gains less than {machine.NOISE:.0%}" in note


@pytest.mark.parametrize("m, expected", [
    # Whole posts from C++ cost nothing beyond their copies: taken for any
    # gain, however small, even where a few rows hide almost no compute.
    (1, ("hoist", 1)),
    (512, ("hoist", 1)),
    (4096, ("hoist", 1)),
    # Pieces (on the Python evaluator) still win where compute is long.
    (8192, ("hoist", 4)),
    (16384, ("hoist", 4)),
])
def test_whole_posts_from_the_cpp_executor_are_taken_for_any_gain(m, expected):
    transfers, computes = _stack_times(H100, m)
    mode, chunks, note = machine.choose_hoisting(H100, transfers, computes, cpp_posts=True)
    handoff = machine.HANDOFF_US * 1e-3
    estimates = {
        ("sequential", 1): machine.pipeline_ms(transfers, computes, depth=1),
        ("hoist", 1): machine.pipeline_ms(transfers, computes, handoff_ms=machine.CPP_HANDOFF_US * 1e-3),
        ("hoist", 4): machine.pipeline_ms(transfers, computes, 4, step_ms=machine.PIECE_US * 1e-3,
                                          handoff_ms=handoff),
    }
    assert estimates[(mode, chunks)] == min(estimates.values()), note
    assert (mode, chunks) == expected, note
    # Without the C++ executor the same shapes keep the margin and the
    # hand-off: a few rows run sequentially.
    if m == 1:
        assert machine.choose_hoisting(H100, transfers, computes)[:2] == ("sequential", 1)


@pytest.mark.parametrize("evaluator", ["cpp", "python"])
def test_the_executor_tells_the_model_which_evaluator_posts(evaluator, monkeypatch):
    from hostir import cpp

    if evaluator == "cpp" and not cpp.available():
        pytest.skip(f"hostir._C is not built: {cpp.reason()}")
    asked = []
    real = machine.choose_hoisting

    def spy(*args, **kwargs):
        asked.append(kwargs.get("cpp_posts"))
        return real(*args, **kwargs)

    monkeypatch.setattr(machine, "choose_hoisting", spy)
    torch.manual_seed(0)
    x, ws = torch.randn(3, H), [torch.randn(H, H) for _ in range(3)]
    (out,) = mlp(3).execute([x, *ws], evaluator=evaluator)
    torch.testing.assert_close(out, reference(x, ws))
    assert asked == [evaluator == "cpp"]


def test_on_the_cpu_hoisting_pays_no_hand_off():
    # Compute as long as the copies: hoisting hides most of them, whole.
    transfers, computes = [2.0] * 6, [2.0] * 6
    assert machine.choose_hoisting(H100, transfers, computes, pieces=False)[:2] == ("hoist", 1)
    # A few rows hide nothing worth the bet: sequential.
    transfers, computes = _stack_times(H100, 1)
    assert machine.choose_hoisting(H100, transfers, computes, pieces=False)[:2] == ("sequential", 1)


def test_pipeline_estimates_bound_the_copy_and_the_compute():
    transfers, computes = [2.0] * 4, [1.0] * 4
    assert machine.pipeline_ms(transfers, computes, depth=1) == 12.0
    assert machine.pipeline_ms(transfers, computes) == 9.0  # all copies, then the last compute
    assert machine.pipeline_ms(transfers, computes, 4) == 8.25
    assert machine.pipeline_ms([1.0] * 4, [2.0] * 4, 4) == 8.25  # a piece of the first copy, then all compute


def test_the_model_chooses_per_input_signature(monkeypatch, capsys):
    # A machine whose copies take as long as 65536 rows compute.
    slow_copies = machine.MachineModel("cpu", 0.05, 0.0, 2.0, 1.0, h2d_gbps=0.0015, d2h_gbps=0.0015)
    monkeypatch.setattr(machine, "CPU_MODEL", slow_copies)
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    fd = mlp(3)
    ws = [torch.randn(H, H) for _ in range(3)]
    notes = []
    for rows in (1, 65536):
        x = torch.randn(rows, H)
        (out,) = fd.execute([x, *ws])
        torch.testing.assert_close(out, reference(x, ws))
        dump = capsys.readouterr().out
        assert "HirAliasChunk" not in dump  # on the CPU, never in pieces
        found = re.search(r"schedule=\((sequential: |hoisted above \d+ compute ops; )(model \(cpu\): [^)]*)\)", dump)
        notes.append((found.group(1), found.group(2)))
    # Each signature's program says the model's estimates for its shapes:
    # one row hides nothing under its compute, 65536 rows hide the copies.
    assert notes[0][0] == "sequential: " and notes[1][0].startswith("hoisted above")
    assert notes[0][1] != notes[1][1] and all("sequential" in n for _, n in notes)
    assert fd.num_programs == 2


@pytest.mark.parametrize("layers", [2, 3, 5])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_weights_in_pieces_are_freed_like_whole_ones(layers, chunks):
    # The dry run follows each device storage until its last view is
    # dropped: the pieces a weight moves in are freed with it, so a hoisted
    # stack holds two layers' weights whatever the chunking.
    x, ws = torch.randn(8, H), [torch.randn(H, H) for _ in range(layers)]
    fd = mlp(layers)
    peak = fd.dry_run([x, *ws], hoisting=Hoisting(chunks=chunks))[0].peak_bytes
    sequential = fd.dry_run([x, *ws], hoisting=Hoisting("sequential", chunks=chunks))[0].peak_bytes
    activations = sequential - WEIGHT
    assert WEIGHT + activations < peak <= 2 * WEIGHT + activations, (peak, activations)
    program = lower(fd.fusion, hoisting=Hoisting(chunks=chunks)).program
    freed = {e.buffer for e in program.exprs if isinstance(e, ir.Deallocate)}
    views = [e.out for e in program.exprs if isinstance(e, ir.HirAliasChunk) and not ir.in_host_memory(e.out)]
    assert len(views) == (2 * layers * chunks if chunks > 1 else 0)
    assert all(v in freed for v in views if v not in program.outputs)
    assert hostir.check_races(program) == []


def test_host_ir_with_inputs_shows_the_choice_for_their_signature(monkeypatch):
    # A machine whose copies take as long as 65536 rows compute.
    slow_copies = machine.MachineModel("cpu", 0.05, 0.0, 2.0, 1.0, h2d_gbps=0.0015, d2h_gbps=0.0015)
    monkeypatch.setattr(machine, "CPU_MODEL", slow_copies)
    fd = mlp(3)
    ws = [torch.randn(H, H) for _ in range(3)]
    few, many = torch.randn(1, H), torch.randn(65536, H)
    assert "sequential: model (cpu)" in fd.host_ir(inputs=[few, *ws])
    assert re.search(r"hoisted above \d+ compute ops; model \(cpu\)", fd.host_ir(inputs=[many, *ws]))
    assert "schedule=(sequential: forced)" in fd.host_ir(inputs=[many, *ws], hoist="sequential")
    # Without inputs: the default hoisting, no model's note.
    default = fd.host_ir()
    assert "hoisted above" in default and "model (" not in default
    # The programs shown are the ones the calls then run.
    shown = fd.num_programs
    (out,) = fd.execute([few, *ws])
    torch.testing.assert_close(out, reference(few, ws))
    assert fd.num_programs == shown
    assert hostir.check_races(fd.host_program(inputs=[few, *ws])) == []
    assert fd.executor.lowered_program(inputs=[few, *ws]).program is fd.host_program(inputs=[few, *ws])
