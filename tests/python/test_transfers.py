"""Host memory as a memory space: inputs defined with `memory="host"` (or
streamed with `host_inputs="stream"`), sets into host memory, and the
`Transfer`s they lower to — golden dumps of the pass, results against eager
torch on every evaluator, the race checker, the dry run's host and device
peaks, and the errors of moves the lowering cannot make. On the CPU a
transfer is a copy, so the whole path runs here."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import hostir
from conftest import check_golden
from hostir import FusionDefinition, ir
from hostir.lower import LoweringError, lower, run_passes
from hostir.lower.build_host_program import build_host_program
from hostir.lower.insert_deallocations import insert_deallocations
from hostir.lower.lower_transfers import lower_transfers

H = 16


def mlp(layers: int = 2, memory: str = "host", dtype=torch.float32):
    """x @ W_l.T, GELU, per layer, with every W_l in `memory`."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H], dtype)
        ws = [fd.define_tensor([H, H], dtype, memory=memory) for _ in range(layers)]
        y = x
        for w in ws:
            y = fd.ops.gelu(fd.ops.linear(y, w))
        fd.add_output(y)
    return fd


def mlp_reference(x, ws):
    for w in ws:
        x = torch.nn.functional.gelu(x @ w.T)
    return x


def offload_output():
    """relu(x @ W.T) computed on the device and returned in host memory."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H])
        w = fd.define_tensor([H, H])
        fd.add_output(fd.ops.set(fd.ops.relu(fd.ops.linear(x, w)), memory="host"))
    return fd


def _pass_dump(fd):
    return run_passes(build_host_program(fd.fusion), [lower_transfers, insert_deallocations])


@pytest.mark.parametrize("case", [lambda: mlp(2), offload_output], ids=["host_weights", "device_to_host"])
def test_golden_dump(case, request):
    check_golden(f"transfer_{request.node.callspec.id}", _pass_dump(case()))


def test_a_host_tensor_read_twice_is_moved_once():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H])
        w = fd.define_tensor([H, H], memory="host")
        a = fd.ops.linear(x, w)
        fd.add_output(fd.ops.linear(a, w))
    program = lower(fd.fusion).program
    transfers = [e for e in program.walk() if isinstance(e, ir.Transfer)]
    assert [t.direction for t in transfers] == ["H2D"]
    x, w = torch.randn(3, H), torch.randn(H, H)
    (out,) = fd.execute([x, w])
    torch.testing.assert_close(out, (x @ w.T) @ w.T)


@pytest.mark.parametrize("hoist", ["sequential", "hoist", "hoist:chunks=2"])
@pytest.mark.parametrize("choice", ["python", "auto"])
def test_host_weights_match_eager_torch(choice, hoist, caplog):
    from hostir import cpp

    torch.manual_seed(0)
    fd = mlp(3)
    x, ws = torch.randn(5, H), [torch.randn(H, H) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="hostir"):
        (out,) = fd.execute([x, *ws], evaluator=choice, hoist=hoist)
    torch.testing.assert_close(out, mlp_reference(x, ws))
    if choice == "auto" and cpp.available():
        # Transfers on the current stream, posted whole ones on a copy
        # stream, and weights moved in pieces (chunk views): the C++
        # executor runs the whole program.
        assert fd.last_runner.name == "cpp", fd.last_runner


@pytest.mark.parametrize("hoist, posted", [("sequential", False), ("hoist", True)])
def test_cpp_evaluator_runs_transfers(hoist, posted):
    # Sequentially every transfer runs on the current stream; hoisted over
    # three layers, the later weights' transfers are posted early, on a copy
    # stream (a lone transfer with nothing to overlap runs on the current one).
    from hostir import cpp

    if not cpp.available():
        pytest.skip(f"hostir._C is not built: {cpp.reason()}")
    torch.manual_seed(0)
    fd = mlp(3)
    x, ws = torch.randn(2, H), [torch.randn(H, H) for _ in range(3)]
    program = fd.host_program(inputs=[x, *ws], hoist=hoist)
    assert any(isinstance(e, ir.Transfer) and e.posted for e in program.walk()) is posted
    for _ in range(2):  # the prepared call too
        (out,) = fd.execute([x, *ws], evaluator="cpp", hoist=hoist)
        torch.testing.assert_close(out, mlp_reference(x, ws))
    assert fd.last_runner.name == "cpp"
    ws[0].mul_(-2.0)  # weights written between calls are read again
    ws[2].mul_(3.0)
    (out,) = fd.execute([x, *ws], evaluator="cpp", hoist=hoist)
    torch.testing.assert_close(out, mlp_reference(x, ws))
    # Other tensors of the same shapes: read from their own memory.
    ws = [torch.randn(H, H) for _ in range(3)]
    (out,) = fd.execute([x, *ws], evaluator="cpp", hoist=hoist)
    torch.testing.assert_close(out, mlp_reference(x, ws))


def test_output_in_host_memory_matches_eager_torch():
    fd = offload_output()
    x, w = torch.randn(4, H), torch.randn(H, H)
    (out,) = fd.execute([x, w])
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, torch.relu(x @ w.T))
    (again,) = fd.execute([x, w], outputs=[torch.empty(4, H)])
    torch.testing.assert_close(again, torch.relu(x @ w.T))


def test_streamed_cpu_inputs_lower_to_transfers(monkeypatch, capsys):
    fd = mlp(2, memory="device")
    x, ws = torch.randn(3, H), [torch.randn(H, H) for _ in range(2)]
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    (out,) = fd.execute([x, *ws], host_inputs="stream")
    dump = capsys.readouterr().out
    torch.testing.assert_close(out, mlp_reference(x, ws))
    assert len(re.findall(r"^\s+Transfer \d+ \(type=H2D", dump, re.M)) == 3, dump
    (copied,) = fd.execute([x, *ws])
    torch.testing.assert_close(copied, out)
    assert fd.num_programs == 2  # streaming is part of the program's key


def test_lowered_programs_have_no_races():
    for fd in (mlp(3), offload_output()):
        program = lower(fd.fusion).program
        assert any(isinstance(e, ir.Transfer) for e in program.walk())
        assert hostir.check_races(program) == []


def test_removing_a_transfers_wait_races():
    # Hoisted: layer 1's transfer runs on a copy stream under layer 0.
    program = lower(mlp(2).fusion).program
    at = next(i for i, e in enumerate(program.exprs) if isinstance(e, ir.Wait))
    mutant = program.derive()
    mutant.exprs = program.exprs[:at] + program.exprs[at + 1 :]
    races = hostir.check_races(mutant)
    assert races and "Transfer" in str(races[0])


def test_the_sequential_program_copies_on_the_current_stream(monkeypatch):
    """Sequentially nothing overlaps a transfer: each runs on the current
    stream, in order with its linear, with no copy stream and no Wait; the
    evaluator never posts one, and the race checker accepts the program."""
    from hostir.lower.hoist_transfers import Hoisting
    from hostir.runtime import transports

    program = lower(mlp(3).fusion, hoisting=Hoisting("sequential")).program
    moves = [e for e in program.exprs if isinstance(e, ir.Transfer)]
    assert len(moves) == 3 and all(e.stream == "current" for e in moves)
    assert not any(isinstance(e, ir.Wait) for e in program.exprs)
    assert "stream=current" in str(program)
    assert hostir.check_races(program) == []

    def no_post(frame, e):
        raise AssertionError(f"Transfer {e.name} was posted on a copy stream")

    monkeypatch.setattr(transports, "post_transfer", no_post)
    torch.manual_seed(0)
    x, ws = torch.randn(5, H), [torch.randn(H, H) for _ in range(3)]
    fd = mlp(3)
    (out,) = fd.execute([x, *ws], hoist="sequential", evaluator="python")
    torch.testing.assert_close(out, mlp_reference(x, ws))
    with pytest.raises(AssertionError, match="posted on a copy stream"):
        fd.execute([x, *ws], hoist="hoist", evaluator="python")


def test_a_transfer_on_the_current_stream_has_no_wait():
    program = lower(mlp(1).fusion, hoisting=None).program
    (t,) = [e for e in program.exprs if isinstance(e, ir.Transfer)]
    with pytest.raises(hostir.HostIrError, match="runs on the current stream: it has no Wait"):
        ir.Wait(t)
    with pytest.raises(hostir.HostIrError, match="'copy' or the 'current' stream"):
        t.replace(stream="side")


def test_dry_run_reports_host_and_device_peaks_apart():
    fd = offload_output()
    report = fd.dry_run([torch.randn(6, H), torch.randn(H, H)])
    rank = report[0]
    assert rank.host_peak_bytes == 6 * H * 4  # the output, in host memory
    assert rank.peak_bytes == 2 * 6 * H * 4  # linear's and relu's results
    assert rank.transfers[0]["direction"] == "D2H" and rank.transfers[0]["bytes"] == 6 * H * 4
    text = str(report)
    assert "host memory: peak 384 B" in text and "transfers: 1 (D2H 384 B)" in text
    assert report.as_dict()["ranks"][0]["memory"]["host_peak_bytes"] == 6 * H * 4


def test_dry_run_of_host_weights_counts_their_device_copies():
    report = mlp(2).dry_run([torch.randn(4, H), torch.randn(H, H), torch.randn(H, H)])
    moved = [t for t in report[0].transfers if t["direction"] == "H2D"]
    assert [t["bytes"] for t in moved] == [H * H * 4] * 2
    assert report[0].host_peak_bytes == 0


def test_bad_memory_word_is_a_definition_error():
    with pytest.raises(hostir.DefinitionError, match='memory must be "device" or "host"'):
        with FusionDefinition() as fd:
            fd.define_tensor([2], memory="pinned")


def test_a_split_host_tensor_is_refused_when_lowering():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        w = fd.define_tensor([8, 8], memory="host")
        fd.add_output(fd.ops.add(x, w))
    w.outer_split(0, 2)
    with pytest.raises(LoweringError, match="host memory and split or sharded"):
        lower(fd.fusion)


def test_a_host_input_on_another_device_is_refused_before_running():
    fd = mlp(1)
    with pytest.raises(hostir.InputError, match=r'in host memory \(memory="host"\) but is on meta'):
        fd.execute([torch.randn(2, H), torch.empty(H, H, device="meta")])


def test_host_inputs_option_is_checked():
    with pytest.raises(ValueError, match="host_inputs must be one of"):
        mlp(1).execute([torch.randn(2, H), torch.randn(H, H)], host_inputs="pin")


def _counting_pinned(monkeypatch) -> list:
    """Count the pinned staging buffers made (each one's shape)."""
    from hostir.runtime.transports import host

    made: list = []
    real = host._empty_pinned

    def counted(shape, dtype):
        made.append(tuple(shape))
        # Without a GPU there is no pinned memory: a plain buffer stands in.
        return real(shape, dtype) if torch.cuda.is_available() else torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(host, "_empty_pinned", counted)
    return made


def test_a_tensor_moved_in_pieces_is_staged_once_whole(monkeypatch):
    from hostir.runtime.transports import HostStaging

    made = _counting_pinned(monkeypatch)
    w = torch.randn(8, 4)
    staging = HostStaging({"w.0": "w", "w.1": "w"})
    bound = {"w": w}
    for _ in range(3):  # calls: the staging is made on the first only
        pieces = [staging.pinned(f"w.{i}", w.narrow(0, 4 * i, 4), bound.get) for i in range(2)]
        for i, piece in enumerate(pieces):
            torch.testing.assert_close(piece, w.narrow(0, 4 * i, 4))
    assert made == [(8, 4)] and len(staging) == 1
    # The pieces are views of the one staging buffer.
    assert pieces[0].untyped_storage().data_ptr() == pieces[1].untyped_storage().data_ptr()
    w.mul_(2.0)  # written since: refreshed in place, not made again
    torch.testing.assert_close(staging.pinned("w.1", w.narrow(0, 4, 4), bound.get), w.narrow(0, 4, 4))
    assert made == [(8, 4)]
    other = torch.randn(8, 4)  # another tensor of the same shape: the same buffer
    bound["w"] = other
    torch.testing.assert_close(staging.pinned("w.0", other.narrow(0, 0, 4), bound.get), other.narrow(0, 0, 4))
    assert made == [(8, 4)]


@pytest.mark.cuda
@pytest.mark.parametrize("hoist", ["hoist", "hoist:chunks=4", "sequential"])
def test_pinned_staging_is_made_once_per_program(cuda_device, monkeypatch, hoist):
    made = _counting_pinned(monkeypatch)
    torch.manual_seed(0)
    fd = mlp(2)
    x = torch.randn(3, H, device=cuda_device)
    ws = [torch.randn(H, H) for _ in range(2)]
    for _ in range(3):
        (out,) = fd.execute([x, *ws], evaluator="python", hoist=hoist)
        torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))
    # One staging per host tensor, made on the first call only, whether
    # the weights move whole or in pieces.
    assert made == [(H, H), (H, H)]
    (program,) = fd.executor._programs.values()
    staging = program.evaluator.staging
    assert len(staging) == 2
    buffers = [e.buffer for e in staging._entries.values()]
    ws[0].mul_(2.0)  # written since: the staging is refreshed in place
    (out,) = fd.execute([x, *ws], evaluator="python", hoist=hoist)
    torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))
    assert all(e.buffer is b for e, b in zip(staging._entries.values(), buffers))
    pinned = [w.pin_memory() for w in ws]  # pinned inputs are read in place
    (out,) = fd.execute([x, *pinned], evaluator="python", hoist=hoist)
    torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))
    assert made == [(H, H), (H, H)]


@pytest.mark.cuda
def test_the_sequential_program_uses_no_copy_stream_on_cuda(cuda_device, monkeypatch):
    from hostir.runtime import transports

    def no_post(frame, e):
        raise AssertionError(f"Transfer {e.name} was posted on a copy stream")

    monkeypatch.setattr(transports, "post_transfer", no_post)
    torch.manual_seed(0)
    fd = mlp(3)
    x = torch.randn(7, H, device=cuda_device)
    for ws in ([torch.randn(H, H) for _ in range(3)], [torch.randn(H, H).pin_memory() for _ in range(3)]):
        for _ in range(2):
            (out,) = fd.execute([x, *ws], hoist="sequential")
            torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))
        ws[1].mul_(3.0)  # a refreshed staging (pageable) or read in place (pinned), on the stream's order
        (out,) = fd.execute([x, *ws], hoist="sequential")
        torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))


@pytest.mark.cuda
def test_the_cpp_executor_posts_transfers_on_a_copy_stream(cuda_device):
    # Whole weights hoisted: the C++ executor posts each transfer on its copy
    # stream, from pinned memory (the weight itself, or its staging where it
    # is pageable), eagerly and under a CUDA graph's capture.
    from hostir import cpp

    if not cpp.available():
        pytest.skip(f"hostir._C is not built: {cpp.reason()}")
    torch.manual_seed(0)
    fd = mlp(3)
    x = torch.randn(7, H, device=cuda_device)
    for ws in ([torch.randn(H, H) for _ in range(3)], [torch.randn(H, H).pin_memory() for _ in range(3)]):
        for _ in range(2):
            (out,) = fd.execute([x, *ws], evaluator="cpp", hoist="hoist")
            torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))
        assert fd.last_runner.name == "cpp"
        ws[2].mul_(3.0)  # written since: a refreshed staging (pageable) or read in place (pinned)
        (out,) = fd.execute([x, *ws], evaluator="cpp", hoist="hoist")
        torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))
    # Back-to-back calls on other pageable tensors, no synchronization
    # between: each call's copies read its own weights.
    calls = [[torch.randn(H, H) for _ in range(3)] for _ in range(4)]
    outs = [fd.execute([x, *ws], evaluator="cpp", hoist="hoist")[0].clone() for ws in calls]
    for out, ws in zip(outs, calls):
        torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in ws]))
    pinned = [torch.randn(H, H).pin_memory() for _ in range(3)]
    (out,) = fd.execute([x, *pinned], evaluator="cpp", hoist="hoist", cuda_graph=True)
    torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in pinned]))
    pinned[0].mul_(-1.0)  # a replay reads the pinned weights in place
    (out,) = fd.execute([x, *pinned], evaluator="cpp", hoist="hoist", cuda_graph=True)
    torch.testing.assert_close(out, mlp_reference(x, [w.to(cuda_device) for w in pinned]))


@pytest.mark.cuda
def test_output_in_host_memory_on_cuda(cuda_device):
    fd = offload_output()
    x, w = torch.randn(4, H, device=cuda_device), torch.randn(H, H, device=cuda_device)
    (out,) = fd.execute([x, w])
    assert out.device.type == "cpu" and out.is_pinned()
    torch.testing.assert_close(out, torch.relu(x @ w.T).cpu())


# ---------------------------------------------------------------- races of hand-built transfers


def _hand_built():
    """x (host) -> T = ALLOCATE; Transfer x -> T; returns the parts."""
    from hostir.container import HostIrContainer

    c = HostIrContainer()
    x = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.host)
    t = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_)
    y = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_)
    c.add_input(x)
    c.add_output(y)
    move = ir.Transfer(c.next_name("transfer"), "H2D", t, x)
    return c, x, t, y, move


def test_reading_a_transfers_output_before_its_wait_races():
    c, x, t, y, move = _hand_built()
    for e in (ir.Allocate(t), move, ir.UnaryOp(y, "relu", t), ir.Wait(move)):
        c.push_back(e)
    races = hostir.check_races(c)
    assert races and any("relu" in r.first.line + r.second.line for r in races), races
    fixed = c.derive()
    for e in (ir.Allocate(t), move, ir.Wait(move), ir.UnaryOp(y, "relu", t)):
        fixed.push_back(e)
    assert hostir.check_races(fixed) == []


def test_freeing_a_transfers_output_before_its_wait_races():
    c, x, t, y, move = _hand_built()
    for e in (ir.Allocate(t), move, ir.Deallocate(t), ir.Wait(move), ir.Set(y, x)):
        c.push_back(e)
    races = hostir.check_races(c)
    assert races and any("Deallocate" in r.first.line + r.second.line for r in races), races


def test_every_pass_of_a_hoisted_chunked_program_is_race_free(monkeypatch):
    monkeypatch.setenv("HOSTIR_CHECK", "races")
    fd = mlp(3)
    x, ws = torch.randn(4, H), [torch.randn(H, H) for _ in range(3)]
    (out,) = fd.execute([x, *ws], hoist="hoist:chunks=4")
    torch.testing.assert_close(out, mlp_reference(x, ws), rtol=1e-4, atol=1e-5)


def test_a_rank_outside_a_host_tensors_mesh_drops_its_transfer_and_wait():
    from hostir import DeviceMesh

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H])
        w = fd.define_tensor([H, H], memory="host")
        v = fd.define_tensor([H, H], memory="host")
        y = fd.ops.linear(x, w)
        z = fd.ops.linear(y, v)
        fd.add_output(z)
    for tv in (x, w, v, y, z):
        tv.set_device_mesh(DeviceMesh([0]))
    on_mesh = lower(fd.fusion, rank=0, backend="gloo").program
    # v's transfer is hoisted above the first linear, so both are posted.
    moves = [type(e).__name__ for e in on_mesh.exprs if isinstance(e, (ir.Transfer, ir.Wait))]
    assert moves == ["Transfer", "Transfer", "Wait", "Wait"]
    elsewhere = lower(fd.fusion, rank=1, backend="gloo").program
    assert not any(isinstance(e, (ir.Transfer, ir.Wait)) for e in elsewhere.exprs)
