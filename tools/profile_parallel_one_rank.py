"""Host cost of `hostir.parallel` at world size 1, against eager torch, on
the CPU (or a GPU): the Llama MLP and attention projections of
bench_training, small shapes, steps of the two alternated so that both see
the same load. Prints the minimum and the quartile step time of each and
their ratio; `--profile` adds cProfile's top functions of the hostir steps.

    PYTHONPATH=python python3 tools/profile_parallel_one_rank.py --shape 64,128,16
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pathlib
import pstats
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_training as bt  # noqa: E402

import hostir  # noqa: E402
from hostir.parallel import parallelize_module  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="mlp,attn_proj")
    ap.add_argument("--shape", default="64,128,16", help="hidden,intermediate,tokens")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, i, t = (int(v) for v in args.shape.split(","))
    mesh = hostir.DeviceMesh(range(1)).to_torch("cpu")
    for kind in args.kinds.split(","):
        torch.manual_seed(0)
        base = bt.MLP(h, i, torch.float32, "cpu") if kind == "mlp" else bt.AttnProj(h, max(h // 8, 1), torch.float32, "cpu")
        x = torch.randn(t, h).requires_grad_()
        grads = [torch.randn_like(o) for o in base(x)]
        par = copy.deepcopy(base)
        parallelize_module(par, mesh, bt.plan(kind))
        steps = {"eager": bt.module_step(base, x, grads), "hostir.parallel": bt.module_step(par, x, grads)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(20):
            for s in steps.values():
                s()
        for _ in range(args.steps):
            for name, s in steps.items():
                t0 = time.perf_counter()
                s()
                times[name].append((time.perf_counter() - t0) * 1e3)
        stats = {k: (min(v), sorted(v)[len(v) // 4]) for k, v in times.items()}
        e, p = stats["eager"], stats["hostir.parallel"]
        print(
            f"{kind} [{h}, {i}, {t}]: eager min {e[0]:.3f} ms (p25 {e[1]:.3f}), hostir.parallel min {p[0]:.3f} ms "
            f"(p25 {p[1]:.3f}): {p[0] / e[0]:.2f}x at the minimum, +{p[0] - e[0]:.3f} ms"
        )
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                steps["hostir.parallel"]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
