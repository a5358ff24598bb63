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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType, communicator, machine, planner
from hostir.lower.schedule import parse
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--rows", type=int, default=256)
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
    for name, fd, inputs, ref in cases(D, rank, dev, m, K, N):
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
    for name, fd, inputs, ref in cases(D, rank, dev, m, K, N):
        label = f"{name} fd.execute(schedule='ring:transport=cuda,chunks=2')"
        try:
            kwargs = {"schedule": "ring:transport=cuda,chunks=2", "backend": "gloo"}
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
