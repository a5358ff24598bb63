#!/usr/bin/env python3
"""Training through hostir on one GPU: forward+backward parity with eager torch.

    python3 tools/check_training_gpu.py --out DIR                       # one rank on CUDA
    torchrun --standalone --nproc-per-node 2 tools/check_training_gpu.py --out DIR
                                                                        # two ranks sharing the GPU

One rank: `torch.autograd.gradcheck` in float64 on CUDA of fusions covering
the transpose rules (linear with bias, matmul, gelu, silu, tanh, sum, max,
shape ops), and Hugging Face's `LlamaForCausalLM` (small config, random
weights) parallelized on a 1-rank mesh by its own plan through
`hostir.parallel` against the unsharded model: logits, loss, every
gradient, three AdamW steps.

Two ranks sharing the GPU: the process group is gloo (NCCL refuses two
ranks on one GPU) and the rings run on the `cuda` copy-engine transport
(`schedule="ring:transport=cuda"`): the AG+matmul and matmul+ReduceScatter
layers forward and backward (the backward's re-gather and its gather of the
output gradient are rings too), and a sequence-parallel rowwise Linear as
`hostir.parallel` defines it (the GEMM+RS ring walking the sequence of a
[b, s, h] activation, with a bias; in the backward the AG+GEMM ring of the
output gradient) and a sequence-parallel colwise Linear
(the AG+GEMM ring forward; in the backward the GEMM+RS ring for the input
gradient, the re-gather of the saved shard posted before it), every result
and gradient compared with eager torch on the whole tensors.

Rank 0 prints a table and writes check_training_gpu_ws<N>.json under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import traceback

import torch

import hostir
from hostir import FusionDefinition, communicator, overlap

F64 = torch.float64


def gradcheck_rules(device):
    cases = {}

    def fd_mlp():
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1], F64)
            w1 = fd.define_tensor([-1, -1], F64)
            b1 = fd.define_tensor([-1], F64)
            w2 = fd.define_tensor([-1, -1], F64)
            h = fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh")
            fd.add_output(fd.ops.sum(fd.ops.tanh(fd.ops.linear(h, w2)), [1]))
        return fd, [(3, 4), (5, 4), (5,), (2, 5)]

    def fd_matmul():
        with FusionDefinition() as fd:
            a = fd.define_tensor([-1, -1, -1], F64)
            b = fd.define_tensor([-1, -1], F64)
            y = fd.ops.silu(fd.ops.matmul(a, b))
            fd.add_output(fd.ops.max(fd.ops.permute(y, [2, 0, 1]), [0]))
        return fd, [(2, 3, 4), (4, 5)]

    def fd_shapes():
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, 6], F64)
            s = fd.ops.slice(fd.ops.reshape(x, [-1, 3, 2]), [0, 1, 0], [None, 3, 2], [1, 1, 1])
            fd.add_output(fd.ops.mul(s, s))
        return fd, [(4, 6)]

    for name, make in (("linear+gelu(tanh)+tanh+sum", fd_mlp), ("matmul+silu+permute+max", fd_matmul), ("reshape+slice+mul", fd_shapes)):
        try:
            fd, shapes = make()
            inputs = tuple(torch.randn(*s, dtype=F64, device=device).requires_grad_() for s in shapes)
            ok = torch.autograd.gradcheck(lambda *xs: tuple(fd.execute(list(xs))), inputs, eps=1e-6, atol=1e-5)
            cases[f"gradcheck {name}"] = "pass" if ok else "FAIL"
        except Exception as err:
            cases[f"gradcheck {name}"] = f"FAIL {type(err).__name__}: {err}"
            traceback.print_exc()
    return cases


def llama_parity(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hostir.parallel import parallelize_module

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device)
    ref = copy.deepcopy(model)
    mesh = hostir.DeviceMesh([0]).to_torch("cuda")
    parallelize_module(model.model, mesh, dict(config.base_model_tp_plan))
    ids = torch.randint(0, config.vocab_size, (2, 16), device=device)
    tol = {"rtol": 1e-4, "atol": 1e-4}
    out, exp = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, exp.logits, **tol)
    out.loss.backward()
    exp.loss.backward()
    ours = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        g = ours[name].grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        torch.testing.assert_close(g, p.grad, **tol)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    losses = []
    for _ in range(3):
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        a, b = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(a, b, **tol)
        a.backward(), b.backward()
        losses.append((a.item(), b.item()))
    return {"llama base_model_tp_plan, 1 rank": f"pass (losses {[round(x, 4) for x, _ in losses]})"}


def shared_gpu_layers(device, world, rank, sched):
    cases = {}
    kwargs = {"schedule": sched, "backend": "gloo", "device": device, "number_of_streams": 2}
    tol = {"rtol": 1e-4, "atol": 1e-4}
    D, m, K, N = world, 64, 96, 80
    try:
        torch.manual_seed(0)
        X, W, G = torch.randn(D, m, K, device=device), torch.randn(K, N, device=device), torch.randn(D, m, N, device=device)
        fd = overlap.allgather_matmul(D)
        (x, w), expected = overlap.allgather_matmul_inputs(X, W, rank)
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        (y,) = fd.execute([x, w], **kwargs)
        torch.testing.assert_close(y, expected, **tol)
        y.backward(G)
        torch.testing.assert_close(x.grad, (G @ W.T)[rank : rank + 1], **tol)
        torch.testing.assert_close(w.grad, X.reshape(-1, K).T @ G.reshape(-1, N), **tol)
        from hostir.autograd import training_of

        dump = training_of(fd, (0, 1)).backward.host_ir()
        cases["AG+matmul fwd+bwd"] = "pass" + (" (backward re-gathers in a ring)" if "(ring," in dump else "")
    except Exception as err:
        cases["AG+matmul fwd+bwd"] = f"FAIL {type(err).__name__}: {err}"
        traceback.print_exc()
    try:
        torch.manual_seed(1)
        A, B = torch.randn(D * m, D * 16, device=device), torch.randn(D * 16, N, device=device)
        G = torch.randn(D * m, N, device=device)
        fd = overlap.matmul_reduce_scatter(D)
        (a, b), expected = overlap.matmul_reduce_scatter_inputs(A, B, D, rank)
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        (y,) = fd.execute([a, b], **kwargs)
        torch.testing.assert_close(y.reshape(expected.shape), expected, **tol)
        g = G.reshape(D, m, N)[rank : rank + 1]
        y.backward(g.reshape(y.shape))
        (da, db), _ = overlap.matmul_reduce_scatter_inputs(G @ B.T, A.T @ G, D, rank)
        torch.testing.assert_close(a.grad, da, **tol)
        torch.testing.assert_close(b.grad, db, **tol)
        cases["matmul+RS fwd+bwd"] = "pass"
    except Exception as err:
        cases["matmul+RS fwd+bwd"] = f"FAIL {type(err).__name__}: {err}"
        traceback.print_exc()
    try:
        # A sequence-parallel rowwise Linear as hostir.parallel defines it for
        # RowwiseParallel(output_layouts=Shard(1)): x [b, s, h] and w sharded
        # on h, the output on s; the GEMM+RS ring walking the sequence.
        from torch.distributed.tensor import Shard

        from hostir.parallel import _Linear

        torch.manual_seed(2)
        Bt, S, H = 2, 4 * D, 16 * D
        X, Wt, bias = torch.randn(Bt, S, H, device=device), torch.randn(N, H, device=device), torch.randn(N, device=device)
        G = torch.randn(Bt, S, N, device=device)
        fd = _Linear(hostir.DeviceMesh(range(D)).to_torch("cpu"), Shard(-1), Shard(1), True, "rowwise")._define(
            3, torch.float32, True, ("shard", 2), Shard(-1)
        )
        # The weight is sharded on h, and the bias replicated, as the
        # module's DTensor parameters place them.
        w_tv, b_tv = fd.fusion.inputs[1], fd.fusion.inputs[2]
        for tv in (w_tv, b_tv):
            tv.set_device_mesh(hostir.DeviceMesh(range(D)))
        w_tv.outer_split(1, D)
        w_tv.axis(1).parallelize(hostir.ParallelType.mesh_x)
        x = X.chunk(D, 2)[rank].contiguous().requires_grad_()
        w = Wt.chunk(D, 1)[rank].contiguous().requires_grad_()
        b = bias.clone().requires_grad_()
        (y,) = fd.execute([x, w, b], **kwargs)
        torch.testing.assert_close(y, (X @ Wt.T + bias).chunk(D, 1)[rank], **tol)
        y.backward(G.chunk(D, 1)[rank].contiguous())
        torch.testing.assert_close(x.grad, (G @ Wt).chunk(D, 2)[rank], **tol)
        torch.testing.assert_close(w.grad, (G.reshape(-1, N).T @ X.reshape(-1, H)).chunk(D, 1)[rank], **tol)
        torch.testing.assert_close(b.grad, G.sum((0, 1)), **tol)
        from hostir.autograd import training_of

        training = training_of(fd, (0, 1, 2))
        plain = [x.detach(), w.detach(), b.detach()]
        forward = training.forward.host_ir(inputs=plain, **kwargs)
        g = G.chunk(D, 1)[rank].contiguous()
        backward = training.backward.host_ir(inputs=[g] + [plain[i] for _, i in training.derivation.saved], **kwargs)
        rings = "(ring," in forward and "(ring," in backward
        cases["SP rowwise Linear (GEMM+RS, bwd AG+GEMM) fwd+bwd"] = "pass" + (" (rings)" if rings else "")
    except Exception as err:
        cases["SP rowwise Linear (GEMM+RS, bwd AG+GEMM) fwd+bwd"] = f"FAIL {type(err).__name__}: {err}"
        traceback.print_exc()
    try:
        # A sequence-parallel colwise Linear as hostir.parallel defines it for
        # ColwiseParallel(input_layouts=Shard(1)): x [b, s, h] sharded on s,
        # w and the bias on N; the forward is the AG+GEMM ring walking the
        # sequence, the backward's input gradient the GEMM+RS ring walking
        # it, with the re-gather of x for the weight gradient under it.
        from torch.distributed.tensor import Shard

        from hostir.autograd import training_of
        from hostir.parallel import _Linear

        torch.manual_seed(3)
        Bt, S, H = 2, 4 * D, 16
        X, Wt, bias = torch.randn(Bt, S, H, device=device), torch.randn(N, H, device=device), torch.randn(N, device=device)
        G = torch.randn(Bt, S, N, device=device)
        fd = _Linear(hostir.DeviceMesh(range(D)).to_torch("cpu"), Shard(1), Shard(-1), True, "colwise")._define(
            3, torch.float32, True, ("shard", 1), Shard(1)
        )
        for tv in fd.fusion.inputs[1:]:
            tv.set_device_mesh(hostir.DeviceMesh(range(D)))
            tv.outer_split(0, D)
            tv.axis(0).parallelize(hostir.ParallelType.mesh_x)
        x = X.chunk(D, 1)[rank].contiguous().requires_grad_()
        w = Wt.chunk(D, 0)[rank].contiguous().requires_grad_()
        b = bias.chunk(D, 0)[rank].contiguous().requires_grad_()
        (y,) = fd.execute([x, w, b], **kwargs)
        torch.testing.assert_close(y, (X @ Wt.T + bias).chunk(D, 2)[rank], **tol)
        g = G.chunk(D, 2)[rank].contiguous()
        y.backward(g)
        torch.testing.assert_close(x.grad, (G @ Wt).chunk(D, 1)[rank], **tol)
        torch.testing.assert_close(w.grad, (G.reshape(-1, N).T @ X.reshape(-1, H)).chunk(D, 0)[rank], **tol)
        torch.testing.assert_close(b.grad, G.sum((0, 1)).chunk(D, 0)[rank], **tol)
        training = training_of(fd, (0, 1, 2))
        plain = [x.detach(), w.detach(), b.detach()]
        forward = training.forward.host_ir(inputs=plain, **kwargs)
        saved = [g if kind == "cotangent" else plain[i] for kind, i in training.derivation.saved]
        backward = training.backward.host_ir(inputs=[g] + saved, **kwargs)
        rings = "(ring," in forward and "(ring," in backward.split("type=Allgather")[1]
        cases["SP colwise Linear (AG+GEMM, bwd GEMM+RS) fwd+bwd"] = "pass" + (" (rings, re-gather under the bwd ring)" if rings else "")
    except Exception as err:
        cases["SP colwise Linear (AG+GEMM, bwd GEMM+RS) fwd+bwd"] = f"FAIL {type(err).__name__}: {err}"
        traceback.print_exc()
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--schedule", default="ring:transport=cuda")
    args = ap.parse_args()
    world, rank = hostir.world_size(), hostir.rank()
    device = torch.device("cuda", 0 if world > 1 and torch.cuda.device_count() == 1 else hostir.local_rank())
    torch.cuda.set_device(device)
    if world > 1:
        communicator.get(backend="gloo", timeout=120)
        cases = shared_gpu_layers(device, world, rank, args.schedule)
    else:
        cases = gradcheck_rules(device)
        try:
            cases.update(llama_parity(device))
        except Exception as err:
            cases["llama base_model_tp_plan, 1 rank"] = f"FAIL {type(err).__name__}: {err}"
            traceback.print_exc()
    if rank == 0:
        print(f"check_training_gpu: {torch.cuda.get_device_name(device)}, {world} rank(s)")
        for name, verdict in cases.items():
            print(f"  {name}: {verdict}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"check_training_gpu_ws{world}.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "world_size": world, "cases": cases}, f, indent=2)
    if any(not str(v).startswith("pass") for v in cases.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
