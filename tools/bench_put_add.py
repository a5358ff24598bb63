"""Times the ways to add rows into a tensor at an index on one GPU (the
`put_add` op, `take`'s transpose, which a MoE layer's backward runs twice),
on the shapes of `bench_moe.py`: T tokens of k choices over D ranks,
hidden H, bf16, and checks each against `index_add_` in float64.

    python3 tools/bench_put_add.py [--tokens 8192] [--topk 8] [--hidden 4096] [--ranks 2] [--out FILE.md]

Two index patterns, as the MoE backward has them:
* `combine`: the pairs' gradients [T*k, H] put into the dispatch's slots
  [D*B, H] (B = T*k/D * 2, half of them empty): every slot receives at
  most one row;
* `dispatch`: the slots' gradients [D*B, H] summed into the tokens [T, H]:
  each token receives k rows, an empty slot (-1) none.

Ways:
* `index_add_bf16`: `index_add_` on bf16 (atomic adds);
* `index_put_acc`: `index_put_(..., accumulate=True)` (sorts the index,
  sums each run of equal targets);
* `index_add_fp32`: `index_add_` into a float32 buffer, then cast;
* `hostir`: `hostir.runtime.fusion_ops.put_add_rows`, what the op runs;
* `hostir distinct` (combine): the same where the index names each row at
  most once (`distinct`, which a MoE backward's combine has: a route's
  slots), the rows copied in with no atomic adds.

And `take`, whose transpose it is, the other way round on the same
index patterns (the forward's combine picks the pairs' rows from the
slots, its dispatch the slots' rows from the tokens): `index_select`
alone (which leaves an empty slot's row unzeroed) against
`fusion_ops.take_rows`, what the op runs, checked against a gather that
zeroes those rows.

The median of 20 timed calls after 5 warm-ups, CUDA events.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hostir.runtime.fusion_ops import put_add_rows, take_rows


def _time(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _patterns(T: int, k: int, D: int, dev) -> dict:
    """(rows in, index [rows in] into rows out with -1 for none, rows out)."""
    B = 2 * T * k // D
    pairs = T * k
    # Each pair's slot: a random injective map into the D*B slots.
    slots = torch.randperm(D * B, device=dev)[:pairs]
    slot_of_pair = slots.clone()
    slot_of_pair[torch.rand(pairs, device=dev) < 0.05] = -1  # dropped pairs
    token_of_slot = torch.full((D * B,), -1, device=dev, dtype=torch.long)
    token_of_slot[slots] = torch.arange(pairs, device=dev) // k
    return {"combine": (pairs, slot_of_pair, D * B), "dispatch": (D * B, token_of_slot, T)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    T, k, H, D = args.tokens, args.topk, args.hidden, args.ranks
    lines = [
        f"# put_add on {torch.cuda.get_device_name(dev)}",
        "",
        f"T {T}, k {k}, H {H}, D {D}, bfloat16; ms, median of 20 calls. `tools/bench_put_add.py`.",
        "",
        "| pattern | rows in | rows out | index_add_bf16 | index_put_acc | index_add_fp32 | hostir | hostir max error "
        "| hostir distinct | its max error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (rows_in, index, rows_out) in _patterns(T, k, D, dev).items():
        x = torch.randn(rows_in, H, device=dev, dtype=torch.bfloat16)
        flat = torch.where(index < 0, rows_out, index)

        def index_add_bf16():
            out = torch.zeros(rows_out + 1, H, device=dev, dtype=torch.bfloat16)
            return out.index_add_(0, flat, x)[:rows_out]

        def index_put_acc():
            out = torch.zeros(rows_out + 1, H, device=dev, dtype=torch.bfloat16)
            return out.index_put_((flat,), x, accumulate=True)[:rows_out]

        def index_add_fp32():
            out = torch.zeros(rows_out + 1, H, device=dev, dtype=torch.float32)
            return out.index_add_(0, flat, x.float())[:rows_out].to(torch.bfloat16)

        def hostir():
            return put_add_rows(x, index, (rows_out, H), 0, 1)

        def distinct():
            return put_add_rows(x, index, (rows_out, H), 0, 1, distinct=True)

        exact = torch.zeros(rows_out + 1, H, device=dev, dtype=torch.float64).index_add_(0, flat, x.double())
        err = (hostir().double() - exact[:rows_out]).abs().max().item()
        ms = [_time(f) for f in (index_add_bf16, index_put_acc, index_add_fp32, hostir)]
        tail = "— | — |"
        if name == "combine":
            tail = f"{_time(distinct):.3f} | {(distinct().double() - exact[:rows_out]).abs().max().item():.3g} |"
        lines.append(
            f"| {name} | {rows_in} | {rows_out} | " + " | ".join(f"{m:.3f}" for m in ms) + f" | {err:.3g} | {tail}"
        )
    lines += [
        "",
        "take, on the same patterns the other way (rows picked from `rows out` into `rows in`):",
        "",
        "| pattern | rows picked from | rows picked | index_select | hostir | hostir equal |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    for name, (rows_in, index, rows_out) in _patterns(T, k, D, dev).items():
        x = torch.randn(rows_out, H, device=dev, dtype=torch.bfloat16)
        clamped = index.clamp(min=0)
        expected = torch.where((index < 0).unsqueeze(1), 0, x.index_select(0, clamped))
        equal = torch.equal(take_rows(x, index, 0, 1), expected)
        ms = [_time(f) for f in (lambda: x.index_select(0, clamped), lambda: take_rows(x, index, 0, 1))]
        lines.append(f"| {name} | {rows_out} | {rows_in} | {ms[0]:.3f} | {ms[1]:.3f} | {'yes' if equal else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
