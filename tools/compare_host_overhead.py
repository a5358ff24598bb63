"""Host overhead of two trees, paired in one run: before against after.

Runs `tools/bench_host_overhead.py` from each tree in turn, alternating
(before, after, before, after, ...) for ``--rounds`` rounds so that both
trees see the same load on a shared host, and compares per variant:

* microseconds per host op (the runtime's own cost), and
* the ratio of each hostir variant to the hand-written eager loop timed in
  the same process (``÷ eager``), which cancels most of the host's drift.

The figure that decides is the median over rounds of each tree; a tree is
"within 10%" of the other when the after median is at most 1.10× the before
median. Each tree needs its own ``hostir._C`` built against this machine's
torch (``python3 setup.py build_ext --inplace`` in that tree); pass
``--build`` to have this script build both first.

    python3 tools/compare_host_overhead.py --before /path/to/old/tree --after . --rounds 4

Writes ``host_overhead_before_after_<device>.md`` and ``.json`` under
``--out-dir`` (default ``$OUT``, else ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

# variant -> the eager loop it is compared against
PAIRS = {
    "python stream loop": "eager chunked",
    "cpp stream loop": "eager chunked",
    "cuda graph stream loop": "eager chunked",
    "cuda graph, own inputs stream loop": "eager chunked",
    "python flat": "eager flat",
    "cpp flat": "eager flat",
    "cuda graph flat": "eager flat",
    "cuda graph, own inputs flat": "eager flat",
}


def build(tree: pathlib.Path, log: pathlib.Path) -> None:
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "16"))
    with log.open("w") as f:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env, stdout=f,
                       stderr=subprocess.STDOUT, check=True)


def one_run(tree: pathlib.Path, bench: pathlib.Path, extra: list[str], log: pathlib.Path) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(tree / "python"))
        with log.open("w") as f:
            subprocess.run([sys.executable, str(bench), "--out-dir", out, *extra], cwd=tree, env=env, stdout=f,
                           stderr=subprocess.STDOUT, check=True)
        (found,) = pathlib.Path(out).glob("host_overhead_*.json")
        return json.loads(found.read_text())


def per_variant(result: dict) -> dict[str, dict[str, float]]:
    rows = {r["variant"]: r for r in result["results"]}
    table = {}
    for name, eager in PAIRS.items():
        if name in rows and eager in rows:
            r = rows[name]
            table[name] = {
                "us_per_op": r["us_per_op"],
                "x_eager": r["us_per_compute_op"] / rows[eager]["us_per_compute_op"],
            }
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=pathlib.Path, help="the tree before the change")
    ap.add_argument("--after", default=pathlib.Path("."), type=pathlib.Path, help="the tree after (default: .)")
    ap.add_argument("--rounds", type=int, default=3, help="before/after pairs, alternating (default: 3)")
    ap.add_argument("--build", action="store_true", help="build hostir._C in both trees first")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("bench_args", nargs="*", help="arguments passed to bench_host_overhead.py (after --)")
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.build:
        for name, tree in trees.items():
            build(tree, out / f"build_{name}.log")
    # Each tree runs its own benchmark (the package's API may have moved
    # between them); only the variants both report are compared.
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    meta = {}
    for i in range(args.rounds):
        for name in ("before", "after"):
            result = one_run(trees[name], trees[name] / "tools" / "bench_host_overhead.py", args.bench_args, out / f"run{i}_{name}.log")
            meta = {k: result.get(k) for k in ("device", "torch", "cuda", "nccl", "python", "params")}
            runs[name].append(per_variant(result))
            print(f"round {i} {name}: " + ", ".join(f"{v} {t['us_per_op']:.2f} us/op {t['x_eager']:.2f}x"
                                                    for v, t in runs[name][-1].items()), flush=True)
    lines = [
        f"# Host overhead, before against after ({meta.get('device')})",
        "",
        f"torch {meta.get('torch')}, CUDA {meta.get('cuda')}, NCCL {meta.get('nccl')}, Python {meta.get('python')}; "
        f"`tools/bench_host_overhead.py` {meta.get('params')}; {args.rounds} rounds, the trees alternating.",
        f"before: `{args.before}`; after: `{args.after}` (as given on the command line).",
        "",
        "| variant | before µs/host op | after µs/host op | after ÷ before | before ÷ eager | after ÷ eager | within 10% |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    summary = {}
    for variant in PAIRS:
        if not all(variant in r for rs in runs.values() for r in rs):
            continue
        med = {n: {k: statistics.median(r[variant][k] for r in rs) for k in ("us_per_op", "x_eager")}
               for n, rs in runs.items()}
        ratio = med["after"]["us_per_op"] / med["before"]["us_per_op"]
        x_ratio = med["after"]["x_eager"] / med["before"]["x_eager"]
        ok = min(ratio, x_ratio) <= 1.10
        summary[variant] = {"before": med["before"], "after": med["after"], "after_over_before": ratio,
                            "x_eager_after_over_before": x_ratio, "within_10pct": ok}
        lines.append(f"| {variant} | {med['before']['us_per_op']:.2f} | {med['after']['us_per_op']:.2f} | {ratio:.2f} | "
                     f"{med['before']['x_eager']:.2f} | {med['after']['x_eager']:.2f} | {'yes' if ok else 'no'} |")
    lines += ["", "Medians over the rounds. \"within 10%\": the after tree's µs per host op, or its ratio to the "
              "eager loop of the same process, is at most 1.10× the before tree's."]
    tag = str(meta.get("device") or "unknown").replace(" ", "_")
    (out / f"host_overhead_before_after_{tag}.md").write_text("\n".join(lines) + "\n")
    (out / f"host_overhead_before_after_{tag}.json").write_text(
        json.dumps({"meta": meta, "rounds": runs, "summary": summary}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
