"""`bench_training` on two hostir trees, alternating, on one machine.

A change to the per-call path of training is measured against the tree
before it: each round runs `tools/bench_training.py` (this tree's script)
once with ``PYTHONPATH`` on tree A's ``python/`` and once on tree B's, the
order alternating from round to round (A B, B A, A B, ...) so that a machine
that speeds up or slows down over the run favours neither. Both trees must
import with the C++ executor this machine built (a tree older than an
extension change can take the newer ``_C`` module when the older one's
interface is a subset of it: copy the built module into its package).

    python3 tools/bench_training_ab.py --a python --b /tmp/before/python \\
        --labels after,before --rounds 3 -- --kinds attn_proj,mlp --iters 20

Arguments after ``--`` go to `bench_training.py`. Writes
``training_ab.md`` and ``training_ab.json`` under ``$OUT`` if set, else
``benchmarks/results`` (``--out-dir`` and ``--tag`` change both), and each
run's own results under ``ab_runs/`` there as it finishes; each
row gives the per-run fwd+bwd ms and × eager of both trees, the median ×
eager, and the median host ms per step.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys


def run_once(tree: str, extra: list[str], workdir: pathlib.Path, name: str) -> dict:
    script = pathlib.Path(__file__).with_name("bench_training.py")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(script), "--out-dir", str(out), "--tag", "run", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    sys.stdout.write(done.stdout[-3000:])
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-5000:])
        raise SystemExit(f"bench_training on {tree} failed with exit {done.returncode}")
    (found,) = out.glob("*.json")
    return json.loads(found.read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="tree A's python/ directory")
    ap.add_argument("--b", required=True, help="tree B's python/ directory")
    ap.add_argument("--labels", default="A,B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default="ab")
    ap.add_argument("--out-dir", default=None)
    args, extra = ap.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    labels = args.labels.split(",")
    trees = dict(zip(labels, (args.a, args.b)))
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    out = pathlib.Path(args.out_dir or os.environ.get("OUT") or "benchmarks/results")
    # Each run's own results stay (under <tag>_runs/), so that a run cut
    # short keeps the rounds it finished.
    runs_dir = out / f"{args.tag}_runs"
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for label in order:
            print(f"== round {r + 1}: {label} ({trees[label]})", flush=True)
            runs[label].append(run_once(trees[label], extra, runs_dir, f"{label}{r}"))
    first = runs[labels[0]][0]
    lines = [
        f"# bench_training, two trees alternating: {', '.join(f'{k} = {v}' for k, v in trees.items())}",
        "",
        f"{first['device']}, torch {first['torch']}, {first['dtype']}, tokens {first['tokens']}, "
        f"hidden {first['hidden']}, intermediate {first['intermediate']}, world size {first['world_size']}; "
        f"{args.rounds} rounds, the trees' order alternating",
        "",
        "| layer | variant | tree | fwd+bwd ms (runs) | × eager (runs) | median × eager | host ms (median) |",
        "|---|---|---|---|---|---:|---:|",
    ]
    summary: dict = {"trees": trees, "rounds": args.rounds, "runs": runs, "median_x_eager": {}}
    for kind in first["kinds"]:
        for variant in first["kinds"][kind]:
            for label in labels:
                rows = [run["kinds"][kind][variant] for run in runs[label]]
                if any(row.get("ms") is None for row in rows):
                    continue
                ms = ", ".join(f"{row['ms']:.3f}" for row in rows)
                ratios = [row["x_eager"] for row in rows]
                median = statistics.median(ratios)
                host = statistics.median(row["host_ms"] for row in rows)
                summary["median_x_eager"].setdefault(kind, {}).setdefault(variant, {})[label] = median
                lines.append(
                    f"| {kind} | {variant} | {label} | {ms} | {', '.join(f'{x:.3f}' for x in ratios)} | "
                    f"{median:.3f} | {host:.3f} |"
                )
    text = "\n".join(lines) + "\n"
    print(text)
    (out / f"training_{args.tag}.md").write_text(text)
    (out / f"training_{args.tag}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
