"""Times the ways to run the three products of a MoE layer's weighting
(the combine's k picked rows weighted by the router and summed) on one
GPU, on the shapes of `bench_moe.py` (T tokens, k choices, hidden H,
bf16), each checked against float64:

* `forward`: y [T, 1, H] = w [T, 1, k] @ picked [T, k, H];
* `outer` (the gradient of picked): w^T [T, k, 1] @ g [T, 1, H];
* `dw` (the gradient of w): g [T, 1, H] @ picked^T [T, H, k].

Ways: `bmm` (what torch.matmul runs), `mul` (a broadcast product; for
`outer`, whose inner extent is 1, the same single rounding as the GEMM),
`mul_sum` (the product, then a sum over the inner axis), and for the
forward `embedding_bag` (the pick and the weighted sum in one kernel,
from the slots' rows, with nothing [T, k, H] made).

    PYTHONPATH=python python3 tools/bench_weighting.py [--tokens 8192] [--topk 8] [--hidden 4096]

The median of 20 timed calls after 5 warm-ups, CUDA events; the largest
error against float64 beside each.
"""

from __future__ import annotations

import argparse

import torch
from bench_put_add import _time  # CUDA events, the median of 20 calls after 5 warm-ups


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args(argv)
    T, k, H, dev, dt = args.tokens, args.topk, args.hidden, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows = torch.randn(2 * T * k, H, device=dev, dtype=dt)  # the slots' rows, half of them empty
    slot = torch.randperm(2 * T * k, device=dev)[: T * k].view(T, k)
    picked = rows[slot]  # [T, k, H]
    w = torch.rand(T, 1, k, device=dev, dtype=dt)
    g = torch.randn(T, 1, H, device=dev, dtype=dt)
    cases = {
        "forward": (
            lambda: torch.bmm(w.double(), picked.double()),
            {
                "bmm": lambda: torch.bmm(w, picked),
                "mul_sum": lambda: (w.transpose(1, 2) * picked).sum(1, keepdim=True),
                "embedding_bag": lambda: torch.nn.functional.embedding_bag(
                    slot, rows, per_sample_weights=w.view(T, k), mode="sum"
                ).view(T, 1, H),
            },
        ),
        "outer": (
            lambda: torch.bmm(w.transpose(1, 2).double(), g.double()),
            {
                "bmm": lambda: torch.bmm(w.transpose(1, 2), g),
                "mul": lambda: w.transpose(1, 2) * g,
            },
        ),
        "dw": (
            lambda: torch.bmm(g.double(), picked.transpose(1, 2).double()),
            {
                "bmm": lambda: torch.bmm(g, picked.transpose(1, 2)),
                "mul_sum": lambda: (g * picked).sum(-1).unsqueeze(1),
            },
        ),
    }
    print(f"# the weighting's products, T={T}, k={k}, H={H}, bf16, {torch.cuda.get_device_name()}")
    print("\n| product | way | ms | max abs error vs float64 |\n|---|---|---:|---:|")
    for name, (exact, ways) in cases.items():
        want = exact()
        for way, fn in ways.items():
            err = (fn().double() - want).abs().max().item()
            print(f"| {name} | {way} | {_time(fn):.3f} | {err:.3g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
