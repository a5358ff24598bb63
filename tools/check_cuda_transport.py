#!/usr/bin/env python3
"""Check the cuda (copy-engine, symmetric-memory) transport on one node.

    torchrun --standalone --nproc-per-node 2 tools/check_cuda_transport.py [--out DIR]

Runs hostir's ring decompositions of AG+matmul and matmul+reduce-scatter with
the `cuda` transport through the reference evaluator, every result compared
with eager torch: both ring directions, 1 and 2 chunks per peer, 20 calls
back to back without a host sync (the double-buffered windows), and each
program captured in a CUDA graph per call parity and replayed. The process
group is gloo (symmetric memory rendezvous goes through its store), so the
ranks may share one GPU (`--share-gpu`, the default when there are fewer
GPUs than ranks): NCCL refuses that, symmetric memory need not. It also
measures this machine's model (`hostir.machine.measure`). Rank 0 prints a
table and writes check_cuda_transport.json under --out.

Then the C++ executor's copy-engine transport (csrc/host_ir/transports/
cuda.cpp), step by step, each step printed as it passes: the windows Python
makes and hands over (addresses per rank and parity), one call of a 2-rank
ring (one push and its wait per rank: the rows that came from the peer
checked apart from the rank's own), 20 calls back to back, one CUDA graph
per call parity replayed, and fd.execute(evaluator="cpp") with
hostir.runtime.graphs.capture. Every wait on the GPU has a deadline: a step
whose GPU work never ends (a flag wait no push met) is named and the
process exits. `--only cpp` or `--only python` runs one half.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

import time

from hostir import DeviceMesh, FusionDefinition, ParallelType, communicator, cpp, machine, planner
from hostir.lower.schedule import parse
from hostir.runtime import flat
from hostir.runtime import graphs as hostir_graphs
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.lower import lower
from hostir.runtime.streams import CudaStreams
from hostir.runtime.transports import cuda as cuda_transport


def ag_fusion(D: int):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1, -1], dtype=torch.bfloat16)
        w = fd.define_tensor(shape=[-1, -1], dtype=torch.bfloat16)
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def rs_fusion(D: int):
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[D, D, -1, -1], dtype=torch.bfloat16)
        b = fd.define_tensor(shape=[1, D, -1, -1], dtype=torch.bfloat16)
        c = fd.ops.matmul(a, b)
        y = fd.ops.sum(c, [1])
        fd.add_output(y)
    for tv in (a, b, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    a.axis(1).parallelize(ParallelType.mesh_x)
    b.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.mesh_x)
    c.axis(0).parallelize(ParallelType.stream)
    return fd


def ints(shape, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(torch.bfloat16).to(device)


def cases(D, rank, dev, m, K, N):
    """(name, fusion, local inputs, expected local output)."""
    X = ints((D, m, K), 1, dev)
    W = ints((K, N), 2, dev)
    ag_ref = (X.float() @ W.float()).to(torch.bfloat16)
    A = ints((D * m, D * K), 3, dev)
    B = ints((D * K, N), 4, dev)
    a_loc = A.reshape(D, m, D, K).permute(0, 2, 1, 3)[:, rank : rank + 1].contiguous()
    b_loc = B.reshape(D, K, N)[rank : rank + 1].unsqueeze(0).contiguous()
    rs_ref = (A.float() @ B.float()).reshape(D, m, N)[rank : rank + 1].to(torch.bfloat16)
    return [
        ("AG+matmul", ag_fusion(D), [X[rank : rank + 1], W], ag_ref),
        ("matmul+RS", rs_fusion(D), [a_loc, b_loc], rs_ref),
    ]


def schedule_line(fd) -> str:
    for program in fd.executor._programs.values():
        for line in str(program.container).splitlines():
            if "(ring," in line:
                return line.strip()
    return "no ring in the program"


def gpu_done(label: str, rank: int, seconds: float = 60.0) -> None:
    """Wait for the GPU's work so far, at most `seconds`: past that, name
    the step that never finished and exit (a hung flag wait never returns)."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            print(f"rank {rank}: TIMEOUT after {seconds:.0f} s in step '{label}': the GPU never finished "
                  f"(a flag wait that no push met, or a push that never ran)", flush=True)
            os._exit(3)
        time.sleep(0.001)


def _mismatch(out, ref) -> str:
    got = out.reshape(ref.shape).float()
    bad = (got - ref.float()).abs() > 0
    if not bad.any():
        return ""
    rows = sorted({int(i) for i in bad.nonzero()[:, -2].tolist()})
    return f"rows {rows[:12]} differ, max err {(got - ref.float()).abs().max():.3g}"


def check_cpp(comm, dev, m, K, N, record) -> None:
    """The C++ executor's copy-engine transport, one step at a time."""
    D, rank = comm.world_size, comm.rank
    record("C++ executor loads", cpp.available(), f"{cpp.reason() or ''}")
    if not cpp.available():
        return
    for name, fd, inputs, ref in cases(D, rank, dev, m, K, N):
        for sched in ("ring:transport=cuda", "ring:transport=cuda,chunks=2", "ring:transport=cuda,direction=-1,chunks=2"):
            label = f"C++ {name} {sched}"
            step = "lower and compile"
            try:
                lowered = lower(fd.fusion, rank=rank, backend="gloo", schedule=parse(sched))
                program = lowered.program
                ev = cpp.CppEvaluator(program, device=dev, communicator=comm, rank=lowered.rank)
                reasons = flat.unsupported_reasons(program)
                record(f"{label}: runs in C++", not reasons, "; ".join(reasons))
                opcodes = sorted({i.op for i in ev.flat.instrs})
                record(f"{label}: flat program", "chunk" in opcodes or "chunks" not in sched, " ".join(opcodes))
                bind = dict(zip(program.inputs, inputs))
                step = "first call: windows made and handed over, one push and its wait per peer"
                with torch.no_grad():
                    (out,) = ev.run(bind)
                gpu_done(f"{label}: {step}", rank)
                t = cuda_transport.for_communicator(comm, dev)
                made = [(k, w) for per in t._windows.values() for k, w in per.items() if k and k[0] == "cpp"]
                notes = []
                for key, w in made:
                    bases, flags, flag_bytes = w.addresses()
                    notes.append(f"instr {key[1]} parity {key[3]}: {w.nbytes} B, bases {[hex(b) for b in bases]}, "
                                 f"flags {[hex(f) for f in flags]} ({flag_bytes} B)")
                parities = {k[3] for k, _ in made}
                record(f"{label}: windows for both parities", parities == {0, 1}, " | ".join(notes))
                # The rank's own rows are computed locally; every other block
                # came through a push (AG) or was pushed away and summed (RS).
                record(f"{label}: first call", not _mismatch(out, ref), _mismatch(out, ref))
                step = "20 calls back to back"
                outs = []
                with torch.no_grad():
                    for _ in range(20):
                        outs.append(ev.run(bind)[0])
                gpu_done(f"{label}: {step}", rank)
                bad = [i for i, o in enumerate(outs) if _mismatch(o, ref)]
                record(f"{label}: {step}", not bad, f"calls {bad} wrong: {_mismatch(outs[bad[0]], ref)}" if bad else "")
                step = "CUDA graphs, one per call parity, replayed"
                comm.barrier()
                preset = [torch.empty_like(outs[0]) for _ in range(2)]
                graphs_ = []
                for p in range(2):
                    g = torch.cuda.CUDAGraph()
                    with torch.no_grad(), torch.cuda.graph(g):
                        ev.run({**bind, program.outputs[0]: preset[p]})
                    graphs_.append(g)
                gpu_done(f"{label}: capture", rank)
                comm.barrier()
                bad = []
                for i in range(10):
                    preset[i % 2].fill_(float("nan"))
                    graphs_[i % 2].replay()
                    gpu_done(f"{label}: replay {i} (parity {i % 2})", rank)
                    if _mismatch(preset[i % 2], ref):
                        bad.append(i)
                record(f"{label}: {step}", not bad, f"replays {bad} wrong" if bad else "")
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                record(f"{label}: {step}", False, f"{type(err).__name__}: {str(err)[:300]}")
            comm.barrier()
    for name, fd, inputs, ref in cases(D, rank, dev, m, K, N):
        label = f"C++ {name} fd.execute(schedule='ring:transport=cuda,chunks=2', evaluator='cpp')"
        try:
            kwargs = {"schedule": "ring:transport=cuda,chunks=2", "backend": "gloo", "evaluator": "cpp"}
            (out,) = fd.execute(inputs, **kwargs)
            gpu_done(f"{label}: eager", rank)
            record(f"{label}: eager on {fd.last_runner.name}", fd.last_runner.name == "cpp" and not _mismatch(out, ref),
                   _mismatch(out, ref) or str(fd.last_runner.reasons))
            replay = hostir_graphs.capture(fd, inputs, **kwargs)
            bad = []
            for i in range(6):
                (got,) = replay()
                gpu_done(f"{label}: capture replay {i}", rank)
                if _mismatch(got, ref):
                    bad.append(i)
            record(f"{label}: hostir.runtime.graphs.capture, 6 replays", not bad, f"replays {bad} wrong" if bad else "")
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            record(label, False, f"{type(err).__name__}: {str(err)[:300]}")
        comm.barrier()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--only", choices=("all", "python", "cpp"), default="all")
    args = parser.parse_args()
    comm = communicator.get(backend="gloo", timeout=60)
    D, rank = comm.world_size, comm.rank
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda", comm.local_rank % gpus)
    torch.cuda.set_device(dev)
    # The transport runs on the GPU; gloo carries only the store and metadata.
    comm.device = dev
    streams = CudaStreams(dev)
    rows, info = [], {
        "device": torch.cuda.get_device_name(dev),
        "gpus": gpus,
        "ranks": D,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "probe": None,
    }

    def record(name, ok, note=""):
        rows.append({"check": name, "ok": bool(ok), "note": note})
        if rank == 0:
            print(f"{'PASS' if ok else 'FAIL'}  {name}  {note}", flush=True)

    info["probe"] = planner.p2p_reason(comm)
    info["windows"] = cuda_transport.window_kind(comm)
    record("cuda transport probe", True, f"reason={info['probe']!r}, windows={info['windows']}")
    try:
        model = machine.measure(dev)
        info["model"] = model.__dict__
        record("machine model measured", True, f"{model.gemm_tflops:.0f} TFLOP/s bf16, local copy {model.copy_gbps:.0f} GB/s")
    except Exception as err:  # noqa: BLE001
        record("machine model measured", False, repr(err)[:200])

    m, K, N = args.rows, 128, 256
    if args.only in ("all", "cpp"):
        check_cpp(comm, dev, m, K, N, record)
    for name, fd, inputs, ref in cases(D, rank, dev, m, K, N) if args.only != "cpp" else []:
        for sched in ("ring:transport=cuda", "ring:transport=cuda,chunks=2", "ring:transport=cuda,direction=-1,chunks=2"):
            label = f"{name} {sched}"
            try:
                lowered = lower(fd.fusion, rank=rank, backend="gloo", schedule=parse(sched))
                program = lowered.program
                if rank == 0 and sched.endswith("chunks=2") and name == "AG+matmul":
                    print(program, flush=True)
                ev = HostIrEvaluator(program, streams=streams, device=dev, communicator=comm, rank=lowered.rank)
                bind = dict(zip(program.inputs, inputs))
                with torch.no_grad():
                    (out,) = ev.run(bind)
                torch.cuda.synchronize()
                good = torch.equal(out.reshape(ref.shape), ref)
                record(f"{label}: eager", good, "" if good else f"max err {(out.float().reshape(ref.shape) - ref.float()).abs().max():.3g}")
                # Back to back: 20 calls, no host sync between them.
                outs = []
                with torch.no_grad():
                    for _ in range(20):
                        (o,) = ev.run(bind)
                        outs.append(o)
                torch.cuda.synchronize()
                good = all(torch.equal(o.reshape(ref.shape), ref) for o in outs)
                record(f"{label}: 20 calls back to back", good)
                # One graph per call parity, replayed alternately.
                preset = [torch.empty_like(outs[0]) for _ in range(2)]
                graphs, writes = [], []
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                torch.cuda.synchronize()
                comm.barrier()
                for p in range(2):
                    g = torch.cuda.CUDAGraph()
                    target = preset[p]
                    with torch.no_grad(), torch.cuda.graph(g):
                        ev.run({**bind, program.outputs[0]: target})
                    graphs.append(g)
                    writes.append(target)
                torch.cuda.synchronize()
                comm.barrier()
                ok = True
                for i in range(10):
                    for t in preset:
                        t.fill_(float("nan"))
                    graphs[i % 2].replay()
                    torch.cuda.synchronize()
                    ok = ok and torch.equal(writes[i % 2].reshape(ref.shape), ref)
                record(f"{label}: CUDA graph replays (2 parities x 5)", ok)
                windows = cuda_transport.for_communicator(comm).rendezvous_count
                record(f"{label}: windows rendezvoused so far", True, str(windows))
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                record(label, False, f"{type(err).__name__}: {str(err)[:300]}")
            comm.barrier()
    # The user's path: fd.execute with the schedule forced, then the same
    # calls captured in CUDA graphs by hostir.runtime.graphs and replayed.
    for name, fd, inputs, ref in cases(D, rank, dev, m, K, N) if args.only != "cpp" else []:
        label = f"{name} fd.execute(schedule='ring:transport=cuda,chunks=2')"
        try:
            kwargs = {"schedule": "ring:transport=cuda,chunks=2", "backend": "gloo", "evaluator": "python"}
            (out,) = fd.execute(inputs, **kwargs)
            torch.cuda.synchronize()
            record(f"{label}: eager", torch.equal(out.reshape(ref.shape), ref), schedule_line(fd))
            replay = hostir_graphs.capture(fd, inputs, **kwargs)
            ok = True
            for _ in range(6):
                (got,) = replay()
                torch.cuda.synchronize()
                ok = ok and torch.equal(got.reshape(ref.shape), ref)
            record(f"{label}: hostir.runtime.graphs.capture, 6 replays", ok)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            record(label, False, f"{type(err).__name__}: {str(err)[:300]}")
        comm.barrier()
    if rank == 0:
        path = os.path.join(args.out, "check_cuda_transport.json")
        with open(path, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1, default=str)
        failed = [r for r in rows if not r["ok"]]
        print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed; {path}", flush=True)
    comm.barrier()
    status = 0 if all(r["ok"] for r in rows) else 1
    sys.stdout.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
