"""The grouped GEMM of a MoE layer's exact form on one GPU: hostir's
`grouped_mm` (`fusion_ops.grouped_mm`: `torch._grouped_mm` per batch
element, then the rows past the groups' total zeroed) against
`torch._grouped_mm` alone over the real rows, and its weights' gradient
(`grouped_outer`) against `_grouped_mm` of the transposed rows; beside
them, the capacity-padded form's experts on the same bound: every slot
computed (B / E rows an expert, each source a batched GEMM beside the
shared weights, `fusion_ops.matmul_unexpanded`), and its weights'
gradient summed over the sources (`fusion_ops.sum_of_products`). A step
of the exact form's walk computes the first two; a step of the padded
form's walk, at the same bytes, the last two.

    python3 tools/bench_grouped_mm.py [--rows 131072] [--fill 0.5] [--out FILE.md]

Shapes: a source rank's piece of the exact form at the bench_moe shapes
(2 source ranks, 32 experts a rank, H 4096, F 1536, bfloat16), `--rows`
the bound B on a piece's rows and `--fill` the fraction of them that are
real (at 2 ranks about half: every pair a rank has is the bound). CUDA
events, median of `--repeats` windows of `--iters` calls.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hostir.runtime.fusion_ops import grouped_mm, grouped_outer, matmul_unexpanded, sum_of_products


def timed(fn, iters: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--fill", type=float, default=0.5)
    ap.add_argument("--sources", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    S, R, G, H, F = args.sources, args.rows, args.experts, args.hidden, args.ffn
    real = int(R * args.fill)
    # Each source's real rows spread over the experts at random.
    counts = torch.stack([torch.bincount(torch.randint(0, G, (real,)), minlength=G) for _ in range(S)]).to(dev)
    x = torch.randn(S, R, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G, F, H, device=dev, dtype=torch.bfloat16) / 64
    dy = torch.randn(S, R, F, device=dev, dtype=torch.bfloat16)
    offs = counts.cumsum(-1).to(torch.int32)
    rows = []

    def raw():
        for i in range(S):
            torch._grouped_mm(x[i], w.transpose(-2, -1), offs=offs[i])

    def raw_outer():
        for i in range(S):
            torch._grouped_mm(dy[i].transpose(0, 1), x[i], offs=offs[i])

    # The padded form's layout of the same bound: B / G slots an expert.
    xp, dyp = x.view(S, G, R // G, H), dy.view(S, G, R // G, F)
    wt = w.transpose(-2, -1)
    cases = [
        ("torch._grouped_mm, the real rows", raw),
        ("hostir grouped_mm (zeros past the rows)", lambda: grouped_mm(x, w, counts)),
        ("padded: batched GEMM over every slot", lambda: matmul_unexpanded(xp, wt)),
        ("torch._grouped_mm, weights' gradient", raw_outer),
        ("hostir grouped_outer", lambda: grouped_outer(dy, x, counts, 0)),
        (
            "padded: weights' gradient over every slot, summed over the sources",
            lambda: sum_of_products(dyp.transpose(-2, -1), xp, [0], torch.bfloat16),
        ),
    ]
    for name, fn in cases:
        rows.append((name, timed(fn, args.iters, args.repeats)))
    flops = 2 * S * real * H * F
    lines = [
        f"# Grouped GEMM on {torch.cuda.get_device_name()}",
        "",
        f"{S} source pieces of B = {R} rows, {real} real ({args.fill:.0%}), {G} experts, "
        f"[{F}, {H}] weights, bfloat16; median of {args.repeats} windows of {args.iters} calls.",
        "",
        "| what | ms | TFLOP/s on the real rows |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |" for name, ms in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
