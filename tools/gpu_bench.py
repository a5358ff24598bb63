"""The benchmarks behind hostir's performance figures, in one command on a
machine with 2 GPUs or more (`--ranks N`, default 2: the runs use N of them).

Run from the repository root (python3 with a CUDA torch and matplotlib;
torchrun):

    python3 tools/gpu_bench.py --build --before .before --out "$OUT"    # the whole set, within --budget s
    python3 tools/gpu_bench.py --parts training,sweep --out /tmp/bench   # some parts
    python3 tools/gpu_bench.py --cpu --budget 120 --out /tmp/x           # the small form: 2 gloo ranks

`--build` first builds the C++ executor (`setup.py build_ext --inplace`, as
`tools/gpu_check.py --part build` does) in this tree and in the `--before`
tree at once, within the budget; without it both must be built already.
Then the parts, in this order, which is also their priority: when the
budget (`--budget`, default 540 s) runs short the later ones are skipped,
and the summary says which ran and which did not, and why.

1. `overlap_ag`, `overlap_rs`, `probe3`: `bench_overlap.py` for AG+matmul
   (shard 8192x8192 per rank, weight 8192x4096, bf16) and for matmul+RS
   (M=16384, K=4096 per rank, N=8192): GEMM alone, sequential, torch's
   `fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, and every
   hostir schedule eager and replayed from a CUDA graph, each with its
   host ms; then the hand-written copy-engine rings of `probe3_x2.py`
   at the same shapes (the bar: `--probe`, default `.probe/probe3_x2.py`, a
   copy placed in that ignored folder; a missing copy is said and skipped,
   and so is the probe with `--cpu`: it needs CUDA);
2. `host`: `bench_host_overhead.py --multidevice` (host µs of a steady
   multi-device call) and `bench_host_overhead.py` (host µs per op of
   programs of tiny ops, one GPU) for this tree and, with `--before DIR`,
   for that older checkout (built beside it), alternating (after, before,
   before, after), so before and after come from one run;
3. `training`: `bench_training.py --plans tp,sp` (Llama MLP and attention
   projections, tensor-parallel and sequence-parallel: hostir.parallel,
   torch TP, torch async-TP) at `--ranks` ranks;
4. `sweep`: the AG+matmul M sweep (total M 2048...32768, K 8192, N 4096):
   `auto` and the copy-engine ring, eager and replayed, beside GEMM alone,
   sequential and torch's fused op, with its plot;
5. `llama`: AG+matmul and matmul+RS at Llama-70B's FC1 and FC2 shapes
   (hidden 8192, intermediate 28672 cut over the ranks, 4096 and 8192
   tokens per rank): GEMM alone, sequential, torch's fused op, hostir's
   sequential program, copy-engine ring and `auto`, eager and replayed;
6. `timelines`: one traced eager call per schedule and problem, each drawn
   as a stream timeline (the PNGs of `tools/plot_timeline.py`);
7. `profile`: where a steady call's host time goes, `profile_calls.py`
   (cProfile) on the tiny multi-device call, AG+matmul at 2048 and 8192
   rows per rank, matmul+RS, and the one-GPU stream loop of the Python
   evaluator (this tree and `--before`): logs only, no result file; with
   torch's profiler too on the AG+matmul calls (`--runtime`: the host
   time of each CUDA runtime call);
8. `training_profile`: `bench_training.py --profile` on the tensor-parallel
   rows (hostir.parallel, torch TP, torch async-TP: kernels by device time,
   the device timeline and its gaps), then hostir.parallel with every
   communication hoisted (`HOSTIR_HOIST=hoist`) beside torch TP: logs and
   the tools' own files, no result file.

With `--ranks 4` (a machine with 4 GPUs or more) every part runs at 4
ranks, but the hand-written rings of `probe3` (2 ranks only); the result
files are named for the GPUs used (`h200x4`).

Every part runs in a process group of its own under a time limit; a part
that fails or times out is logged and the rest go on. Logs and every tool's
own outputs go under `--out`, with `gpu_bench_summary.md` and a copy of the
result files written (`--out`/results). The results go to
`benchmarks/results/` (with `--cpu`: `--out`/results, unless `--results`
says), one current file per benchmark and device kind, and the index in its
README is kept true: `overlap_<machine>.md` (both problems, the probe's
rows, the sweep's table), `overlap_sweep_<machine>.png`,
`host_overhead_before_after_<machine>.md` and `training_<machine>.md`,
`<machine>` being `h100x2`, `h200x2`, ... from the device name. The result
files are made from everything under `--out`, so a set split over two calls
with the same `--out` (`--parts overlap_ag,overlap_rs,probe3,host`, then
`--parts training,sweep,timelines`) ends in the same files. Exit status 0
when every part that ran passed; a SIGTERM ends the running part's process
group and still writes what the parts before it left.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import statistics
import sys

from benchlib import REPO, Runner, job_env, machine_tag

RESULTS = REPO / "benchmarks" / "results"
PARTS = (
    "overlap_ag", "overlap_rs", "probe3", "host", "training", "sweep", "llama", "timelines", "profile",
    "training_profile",
)
# The eager schedule rows of bench_overlap (its DECOMPOSITIONS), traced by `timelines`.
SCHEDULE_ROWS = (
    "hostir_ring_nccl,hostir_ring_cuda,hostir_ring_cuda_c2,hostir_ring_cuda_reverse,"
    "hostir_collective,hostir_sequential,hostir_auto"
)
SWEEP_ROWS = "gemm_alone,sequential,symm_mem,hostir_auto*,hostir_ring_cuda*"
# Llama-70B's projections (hidden 8192, intermediate 28672) at tokens per rank.
LLAMA = {"hidden": 8192, "intermediate": 28672, "tokens": (4096, 8192)}
LLAMA_ROWS = (
    "gemm_alone,allgather_alone,reduce_scatter_alone,sequential,symm_mem,hostir_sequential,hostir_ring_cuda,"
    "hostir_ring_cuda_replay,hostir_ring_cuda_c2*,hostir_auto*"
)
# The table at the headline shapes: the old stream-axis programs only on the C++ executor and replayed.
OVERLAP_ROWS = (
    "gemm_alone,allgather_alone,reduce_scatter_alone,sequential,nccl_pipeline_*,hostir_cpp_*,"
    "hostir_cuda_graph_*,hostir_ring*,hostir_collective*,hostir_sequential*,hostir_auto*,symm_mem"
)


@dataclasses.dataclass
class Config:
    """Shapes, iterations and limits (seconds) of one machine kind."""

    ag: tuple[int, int, int]  # rows of a rank's shard, K, N
    rs: tuple[int, int, int]  # total rows M, K of a rank, N
    sweep: str
    iters: int
    warmup: int
    limits: dict[str, float]
    minimum: float  # a part that would get less is skipped


GPU = Config(
    ag=(8192, 8192, 4096),
    rs=(16384, 4096, 8192),
    sweep="2048,4096,8192,16384,32768",
    iters=20,
    warmup=5,
    limits={
        "build": 300,
        "overlap_ag": 150,
        "overlap_rs": 130,
        "probe3": 110,
        "host": 75,
        "training": 240,
        "sweep": 150,
        "llama": 110,
        "timelines": 70,
        "profile": 150,
        "training_profile": 300,
    },
    minimum=30,
)
CPU = Config(
    ag=(64, 32, 16),
    rs=(64, 32, 16),
    sweep="32,64",
    iters=2,
    warmup=1,
    limits={
        "build": 300,
        "overlap_ag": 45,
        "overlap_rs": 40,
        "probe3": 40,
        "host": 60,
        "training": 60,
        "sweep": 40,
        "llama": 40,
        "timelines": 40,
        "profile": 90,
        "training_profile": 90,
    },
    minimum=15,
)


class Bench:
    """One run: the machine, the launcher, the runner of the parts."""

    def __init__(self, args, gpus: list[str]) -> None:
        self.args = args
        self.cpu = args.cpu
        self.cfg = CPU if args.cpu else GPU
        self.ranks = args.ranks
        self.gpus = gpus[: self.ranks]
        self.tag = "cpu" if args.cpu else machine_tag(self.gpus)
        self.out = pathlib.Path(args.out).resolve()
        self.run = Runner(self.out / "logs", args.budget)
        self.before = pathlib.Path(args.before).resolve() if args.before else None
        self.parts = args.parts

    def machine(self) -> str:
        return f"{len(self.gpus)} × {self.gpus[0]}" if self.gpus else f"CPU, {self.ranks} gloo ranks"

    def env(self, tree: pathlib.Path = REPO, **extra: str) -> dict[str, str]:
        env = job_env(extra, tree)
        if self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def launch(self, nprocs: int, program: list[str]) -> list[str]:
        """`program` on `nprocs` ranks of this host (torchrun: the probe reads its variables)."""
        torchrun = shutil.which("torchrun") or str(pathlib.Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", f"--nproc-per-node={nprocs}", "--no-python", *program]

    def step(self, name: str, part: str, command: list[str], env: dict[str, str]) -> bool:
        return self.run.step(name, self.cfg.limits[part], command, env=env, minimum=self.cfg.minimum)

    def dir(self, name: str) -> pathlib.Path:
        path = self.out / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def overlap(self, problem: str, extra: list[str], out: pathlib.Path, name: str, part: str) -> bool:
        m, k, n = self.cfg.ag if problem == "ag" else self.cfg.rs
        program = (
            [
                sys.executable,
                "tools/bench_overlap.py",
                "--problem",
                problem,
                "--M",
                str(m),
                "--K",
                str(k),
                "--N",
                str(n),
                "--iters",
                str(self.cfg.iters),
                "--warmup",
                str(self.cfg.warmup),
                "--out-dir",
                str(out),
                "--tag",
                problem,
            ]
            + (["--cpu"] if self.cpu else [])
            + extra
        )
        return self.step(name, part, self.launch(self.ranks, program), self.env())


# ---------------------------------------------------------------- parts


def part_build(b: Bench) -> None:
    """This tree and the --before tree, built at once; each then loads."""
    trees = [REPO] + ([b.before] if b.before else [])
    jobs = str(max(1, (os.cpu_count() or 2) // len(trees)))
    script = ["set -u", "pids=()"]
    for i, tree in enumerate(trees):
        log = b.out / "logs" / f"build_{i}.log"
        script.append(
            f"(cd '{tree}' && rm -f python/hostir/_C*.so && MAX_JOBS={jobs} "
            f"'{sys.executable}' setup.py build_ext --inplace) >'{log}' 2>&1 & pids+=($!)"
        )
    script.append(
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; tail -n 2 '
        + " ".join(f"'{b.out / 'logs' / f'build_{i}.log'}'" for i in range(len(trees)))
        + "; exit $rc"
    )
    b.run.step("build", b.cfg.limits["build"], ["bash", "-c", "\n".join(script)], env=b.env())
    for label, tree in zip(("this tree", "before"), trees):
        b.run.step(
            f"build_loads_{'after' if tree == REPO else 'before'}",
            60,
            [
                sys.executable,
                "-c",
                f"from hostir import cpp; assert cpp.available(), cpp.reason(); print('C++ executor of {label} loads')",
            ],
            env=b.env(tree),
            minimum=5,
        )


def part_overlap_ag(b: Bench) -> None:
    b.overlap("ag", ["--variants", OVERLAP_ROWS, "--no-timeline"], b.dir("overlap"), "overlap_ag", "overlap_ag")


def part_overlap_rs(b: Bench) -> None:
    b.overlap("rs", ["--variants", OVERLAP_ROWS, "--no-timeline"], b.dir("overlap"), "overlap_rs", "overlap_rs")


def part_probe3(b: Bench) -> None:
    probe = pathlib.Path(b.args.probe)
    probe = probe if probe.is_absolute() else REPO / probe
    if not probe.exists():
        b.run.skip("probe3", f"{probe} is missing: place a copy of probe3_x2.py there (the folder is ignored by git)")
        return
    if b.cpu:
        b.run.skip("probe3", "the hand-written rings need CUDA (copy engines, symmetric memory)")
        return
    if b.ranks != 2:
        b.run.skip("probe3", f"the hand-written rings run at 2 ranks, not {b.ranks}")
        return
    limit = min(b.cfg.limits["probe3"], b.run.left() - 5)
    out = b.dir("probe3")
    env = b.env(
        OUT=str(out),
        PROBE_AG=",".join(map(str, b.cfg.ag)),
        PROBE_RS=",".join(map(str, b.cfg.rs)),
        PROBE_SWEEP="",
        PROBE_ITERS=str(b.cfg.iters),
        # The probe stops itself, with the rows it has, before our limit ends it.
        PROBE_DEADLINE=str(max(10, int(limit) - 15)),
    )
    b.step("probe3", "probe3", b.launch(2, [sys.executable, str(probe)]), env)


def part_host(b: Bench) -> None:
    """After and before alternating, A B B A: a drift of the host over the
    part hits both trees alike."""
    trees = [("after", REPO)] + ([("before", b.before)] if b.before else [])
    order = trees if len(trees) == 1 else [trees[0], trees[1], trees[1], trees[0]]
    seen: dict[str, int] = {}
    for label, tree in order:
        seen[label] = seen.get(label, 0) + 1
        out = b.dir(f"host/{label}_{seen[label]}")
        common = ["--device", "cpu" if b.cpu else "cuda", "--out-dir", str(out)]
        common += ["--iters", "50", "--warmup", "5"] if b.cpu else []
        # This tree's script on both trees, the same measurement; where it
        # fails on the older package, that tree's own script.
        scripts = dict.fromkeys([REPO / "tools" / "bench_host_overhead.py", tree / "tools" / "bench_host_overhead.py"])
        multi = " || ".join(
            shlex.join(b.launch(b.ranks, [sys.executable, str(s), "--multidevice", *common]))
            for s in scripts
            if s.exists()
        )
        # The per-op programs on one device (the first GPU).
        per_op = " || ".join(shlex.join([sys.executable, str(s), *common]) for s in scripts if s.exists())
        command = ["bash", "-c", f"{multi}; a=$?; {per_op}; b=$?; exit $((a | b))"]
        b.step(f"host_{label}_{seen[label]}", "host", command, b.env(tree))


def part_training(b: Bench) -> None:
    n = b.ranks
    program = [
        sys.executable,
        "tools/bench_training.py",
        "--plans",
        "tp,sp",
        "--out-dir",
        str(b.dir("training")),
        "--tag",
        f"np{n}",
    ] + (["--cpu"] if b.cpu else [])
    b.step(f"training_np{n}", "training", b.launch(n, program), b.env())
    if b.before is not None:
        # The --before tree's hostir.parallel rows (this tree's script on
        # that tree's package), in the same lease.
        before = [
            sys.executable, str(REPO / "tools" / "bench_training.py"), "--plans", "tp,sp",
            "--variants", "hostir.parallel", "--out-dir", str(b.dir("training")), "--tag", f"np{n}_before",
        ] + (["--cpu"] if b.cpu else [])
        b.step(f"training_np{n}_before", "training", b.launch(n, before), b.env(b.before))


def part_sweep(b: Bench) -> None:
    _, k, n = b.cfg.ag
    program = [
        sys.executable,
        "tools/bench_overlap.py",
        "--sweep-only",
        "--sweep",
        b.cfg.sweep,
        "--variants",
        SWEEP_ROWS,
        "--K",
        str(k),
        "--N",
        str(n),
        "--iters",
        str(b.cfg.iters),
        "--warmup",
        str(b.cfg.warmup),
        "--no-timeline",
        "--out-dir",
        str(b.dir("sweep")),
        "--tag",
        "ag",
    ] + (["--cpu"] if b.cpu else [])
    b.step("sweep", "sweep", b.launch(b.ranks, program), b.env())


def llama_sizes(b: Bench) -> tuple[int, int, tuple[int, ...]]:
    """(hidden, intermediate, tokens per rank): Llama-70B's, or small ones with --cpu."""
    return (32, 64, (16,)) if b.cpu else (LLAMA["hidden"], LLAMA["intermediate"], LLAMA["tokens"])


def llama_shapes(b: Bench) -> list[tuple[str, str, tuple[int, int, int]]]:
    """(problem, tag, (M, K, N)) of Llama-70B's FC1 (AG+matmul: a rank's
    tokens, hidden, its columns of the intermediate) and FC2 (matmul+RS:
    every rank's tokens, its rows of the intermediate, hidden) per tokens
    per rank; with --cpu the same cuts of small sizes."""
    hidden, inter, tokens = llama_sizes(b)
    shapes = []
    for t in tokens:
        shapes.append(("ag", f"llama_fc1_t{t}", (t, hidden, inter // b.ranks)))
        shapes.append(("rs", f"llama_fc2_t{t}", (t * b.ranks, inter // b.ranks, hidden)))
    return shapes


def part_llama(b: Bench) -> None:
    """AG+matmul and matmul+RS at Llama-70B's FC1/FC2 shapes, each shape a
    step of its own: sequential, torch's fused op, hostir's ring and
    `auto`, eager and replayed, beside GEMM alone."""
    for problem, tag, (m, k, n) in llama_shapes(b):
        program = [
            sys.executable, "tools/bench_overlap.py", "--problem", problem, "--M", str(m), "--K", str(k),
            "--N", str(n), "--iters", str(b.cfg.iters), "--warmup", str(b.cfg.warmup), "--variants", LLAMA_ROWS,
            "--no-timeline", "--out-dir", str(b.dir("llama")), "--tag", tag,
        ] + (["--cpu"] if b.cpu else [])
        b.step(tag, "llama", b.launch(b.ranks, program), b.env())


def part_timelines(b: Bench) -> None:
    for problem in ("ag", "rs"):
        b.overlap(
            problem,
            ["--variants", SCHEDULE_ROWS, "--iters", "1", "--warmup", "1"],
            b.dir("timelines"),
            f"timelines_{problem}",
            "timelines",
        )


def part_profile(b: Bench) -> None:
    """cProfile of steady calls (logs only): where the host time goes."""
    tool = str(REPO / "tools" / "profile_calls.py")
    m_ag, k_ag, n_ag = b.cfg.ag
    m_rs, k_rs, n_rs = b.cfg.rs
    small = str(max(1, m_ag // 4))
    cases = [
        ["--case", "tiny"],
        ["--case", "tiny", "--check-ranks", "first"],
        ["--case", "ag", "--M", small, "--K", str(k_ag), "--N", str(n_ag), "--runtime"],
        ["--case", "ag", "--M", str(m_ag), "--K", str(k_ag), "--N", str(n_ag), "--runtime"],
        ["--case", "rs", "--M", str(m_rs), "--K", str(k_rs * b.ranks), "--N", str(n_rs)],
    ]
    lines = [shlex.join(b.launch(b.ranks, [sys.executable, tool, *case, "--iters", "50"])) for case in cases]
    trees = [("after", REPO)] + ([("before", b.before)] if b.before else [])
    for label, tree in trees:
        # The Python evaluator's stream loop on one device, each tree on its own package.
        command = shlex.join([sys.executable, tool, "--case", "stream_loop", "--iters", "50"])
        lines.append(f"echo '# stream loop, {label}'; PYTHONPATH='{tree / 'python'}' {command}")
    b.step("profile", "profile", ["bash", "-c", "; ".join(lines)], b.env())


def part_training_profile(b: Bench) -> None:
    """One profiled step of each tensor-parallel training row (kernels by
    device time, the device timeline and its gaps), then the hostir rows
    again with every program's communications hoisted (`HOSTIR_HOIST=hoist`)
    beside torch TP: logs and the tools' own files only."""
    out = b.dir("training_profile")
    rows = "hostir.parallel,torch TP" + ("" if b.cpu else ",torch async-TP")
    lines = []
    # Profiled on the C++ executor, as the rows run unprofiled (under a
    # profiler `auto` runs the Python evaluator).
    runs = (("profiled", "HOSTIR_EVALUATOR=cpp ", rows), ("hoisted", "HOSTIR_HOIST=hoist ", "hostir.parallel,torch TP"))
    for tag, env, variants in runs:
        program = [
            sys.executable, "tools/bench_training.py", "--plans", "tp,sp", "--variants", variants,
            "--out-dir", str(out), "--tag", f"np{b.ranks}_{tag}",
        ] + (["--cpu"] if b.cpu else ["--profile"] if tag == "profiled" else [])
        lines.append(env + shlex.join(b.launch(b.ranks, program)))
    b.step("training_profile", "training_profile", ["bash", "-c", "; ".join(lines)], b.env())


# ---------------------------------------------------------------- results


def before_label(tree: pathlib.Path) -> str:
    """The --before tree's commit (its COMMIT file, written beside an
    archive of it), else its folder's name."""
    commit = tree / "COMMIT"
    return commit.read_text().strip() if commit.exists() else tree.name


def demote(text: str) -> str:
    """A tool's Markdown one heading level down, to sit under a section."""
    return re.sub(r"^(#+) ", r"#\1 ", text, flags=re.M).strip() + "\n"


def probe_table(path: pathlib.Path) -> str:
    """The probe's rows with its own ratios: to GEMM alone, over sequential
    and over torch's fused op of the same group (back-to-back rows against
    the back-to-back baselines), as the probe prints them."""
    data = json.loads(path.read_text())
    base = data.get("base", {})
    lines = [
        "| group | variant | ms | / gemm | × sequential | × symm_mem | host ms | check |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]

    def fmt(v):
        return "—" if v is None else f"{v:.3f}"

    for r in data.get("rows", []):
        g = base.get(r["group"], {})
        suffix = "_b2b" if r.get("mode") == "b2b" else ""
        gemm, seq, symm = (g.get(k + suffix, g.get(k)) for k in ("gemm", "seq", "symm"))
        ms = r.get("ms")
        cells = [
            ms / gemm if ms and gemm else None,
            seq / ms if ms and seq else None,
            symm / ms if ms and symm else None,
        ]
        lines.append(
            f"| {r['group']} | {r['name']} | {fmt(ms)} | {' | '.join(fmt(c) for c in cells)} "
            f"| {fmt(r.get('host'))} | {str(r.get('check', '')).replace('|', '/')} |"
        )
    info = data.get("info", {})
    return (
        "\n".join(lines) + f"\n\nprobe: {info.get('device', '?')}, torch {info.get('torch', '?')}, "
        f"NCCL {info.get('nccl', '?')}.\n"
    )


def host_table(out: pathlib.Path, pattern: str, unit: str) -> str | None:
    """Each variant's median µs per tree over its runs (the files of
    `pattern` under host/), and after / before."""
    runs: dict[str, list[dict]] = {}
    for path in sorted(out.glob(f"host/*/{pattern}")):
        runs.setdefault(path.parent.name.rsplit("_", 1)[0], []).append(json.loads(path.read_text()))
    if not runs.get("after"):
        return None
    labels = [t for t in ("after", "before") if runs.get(t)]
    medians = {t: {} for t in labels}
    for t in labels:
        names = dict.fromkeys(r["variant"] for run in runs[t] for r in run["results"])
        for name in names:
            medians[t][name] = statistics.median(
                r["median_us"] for run in runs[t] for r in run["results"] if r["variant"] == name
            )
    head = "| variant | " + " | ".join(f"{t} µs/{unit} ({len(runs[t])} runs)" for t in labels)
    lines = [
        head + (" | after / before |" if len(labels) == 2 else " |"),
        "|---|" + "---:|" * (len(labels) + (len(labels) == 2)),
    ]
    for name, after in medians["after"].items():
        cells = [f"{after:.1f}"]
        if len(labels) == 2:
            before = medians["before"].get(name)
            cells += ["—", "—"] if before is None else [f"{before:.1f}", f"{after / before:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    env = runs["after"][0]
    if "ranks" in env:
        lines += [
            "",
            f"{env['ranks']} ranks, transport {env['transport']}, communicator {env['communicator']}, "
            f"steps through {env['steps']}.",
        ]
    lines += ["", f"Device {env['device']}, torch {env['torch']}."]
    first = sorted((out / "host" / "after_1").glob(pattern.replace(".json", ".md")))
    if first:
        lines += ["This tree's first run in full:", "", demote(demote(first[0].read_text()))]
    return "\n".join(lines)


def compose(b: Bench, results: pathlib.Path) -> list[tuple[str, str]]:
    """Write each benchmark's current file from this run's outputs; a
    benchmark none of whose parts left output keeps its earlier file.
    Returns (file name, what it shows) per file written."""
    out, tag, written = b.out, b.tag, []
    stamp = f"{datetime.date.today().isoformat()}, `tools/gpu_bench.py{' --cpu' if b.cpu else ''}`"
    sections = []
    for path in (out / "overlap" / "bench_overlap_ag.md", out / "overlap" / "bench_overlap_rs.md"):
        if path.exists():
            sections.append(demote(path.read_text()))
    probe = out / "probe3" / "probe3_x2_results.json"
    if probe.exists():
        sections.append(
            "## The hand-written copy-engine rings (`probe3_x2.py`, the same shapes, run after "
            "the tables above)\n\n" + probe_table(probe)
        )
    sweep = out / "sweep" / "bench_overlap_ag_sweep.md"
    if sweep.exists():
        sections.append(demote(sweep.read_text()))
        png = sweep.with_suffix(".png")
        if png.exists():
            shutil.copyfile(png, results / f"overlap_sweep_{tag}.png")
            written.append(
                (
                    f"overlap_sweep_{tag}.png",
                    "the AG+matmul M sweep of `overlap`, plotted: ms and speedup over sequential per variant",
                )
            )
            # Named, not linked: docs/performance.md includes this file, where a relative image would not resolve.
            sections[-1] += f"\nThe plot: `benchmarks/results/overlap_sweep_{tag}.png`.\n"
    llama = [b.out / "llama" / f"bench_overlap_{tag}.md" for _, tag, _ in llama_shapes(b)]
    if any(path.exists() for path in llama):
        hidden, inter, _ = llama_sizes(b)
        sections.append(
            f"## Llama-70B's projections (hidden {hidden}, intermediate {inter}), "
            f"FC1 as AG+matmul and FC2 as matmul+RS, per tokens per rank\n\n"
            + "\n".join(demote(demote(path.read_text())) for path in llama if path.exists())
        )
    if sections:
        text = f"# Overlap on {b.machine()}\n\n{stamp}.\n\n" + "\n".join(sections)
        (results / f"overlap_{tag}.md").write_text(text)
        written.insert(
            0,
            (
                f"overlap_{tag}.md",
                "AG+matmul and matmul+RS: GEMM alone, sequential, torch's fused "
                "ops, every hostir schedule eager and replayed with host ms; the hand-written rings "
                "(probe3); the M sweep; Llama-70B's FC1/FC2 shapes",
            ),
        )
    multi = host_table(out, "host_overhead_multidevice_*.json", "call")
    per_op = host_table(out, "host_overhead_c[pu][ud]*.json", "run")
    if multi or per_op:
        body = "".join(
            f"## {title}\n\n{table}\n"
            for title, table in (
                ("A steady multi-device call (`--multidevice`)", multi),
                ("Programs of tiny ops on one device", per_op),
            )
            if table
        )
        (results / f"host_overhead_before_after_{tag}.md").write_text(
            f"# Host µs, this tree and the one before, on {b.machine()}\n\n{stamp}: "
            "`bench_host_overhead.py` and its `--multidevice` mode on each tree, runs alternating "
            f"(after, before, before, after); each tree's median over its runs of each run's median.\n\n{body}"
        )
        written.append(
            (
                f"host_overhead_before_after_{tag}.md",
                "`bench_host_overhead.py` (per op, one device) and "
                "its `--multidevice` mode on this tree and an older checkout, alternating runs of one "
                "gpu_bench run: host µs before and after",
            )
        )
    training = sorted((out / "training").glob("bench_training_np*.md")) if (out / "training").exists() else []
    if training:
        body = "\n".join(
            (f"The tree before ({before_label(b.before)}), hostir.parallel only, run after the table above:\n\n"
             if p.stem.endswith("_before") else "") + demote(p.read_text())
            for p in sorted(training, key=lambda p: p.stem.endswith("_before"))
        )
        (results / f"training_{tag}.md").write_text(f"# Training steps on {b.machine()}\n\n{stamp}.\n\n{body}")
        written.append(
            (
                f"training_{tag}.md",
                "`bench_training.py --plans tp,sp`: Llama MLP and attention "
                "projections fwd+bwd, hostir.parallel, torch TP and async-TP, tensor- and "
                "sequence-parallel",
            )
        )
    return written


def index(results: pathlib.Path, written: list[tuple[str, str]], device: str) -> None:
    """Keep the README's table true: a row per file written (its cited-by
    and was columns kept where the row existed)."""
    readme = results / "README.md"
    if not readme.exists():
        return
    lines = readme.read_text().splitlines()
    date = datetime.date.today().isoformat()
    for name, what in written:
        prefix = f"| [{name}]({name}) |"
        old = next((i for i, line in enumerate(lines) if line.startswith(prefix)), None)
        kept = ["—", ""]
        if old is not None:
            cells = [c.strip() for c in lines[old].strip().strip("|").split("|")]
            kept = cells[3:5] if len(cells) >= 5 else kept
        row = f"{prefix} {what} | {device}, {date} | {kept[0]} | {kept[1]} |"
        if old is not None:
            lines[old] = row
        else:
            end = next(i for i, line in enumerate(lines) if line.startswith("| README.md |"))
            lines.insert(end, row)
    readme.write_text("\n".join(lines) + "\n")


def summary(b: Bench, written: list[str], results: pathlib.Path) -> str:
    steps = b.run.steps
    ran = [s for s in steps if not s["status"].startswith("skipped")]
    skipped = [s for s in steps if s["status"].startswith("skipped")]
    lines = [
        f"# gpu_bench on {b.machine()}",
        "",
        f"Budget {b.args.budget:.0f} s, used {b.args.budget - b.run.left():.0f} s; parts asked: {', '.join(b.parts)}.",
        "",
        "| step | result | seconds | last line |",
        "|---|---|---:|---|",
    ]
    lines += [
        f"| {s['step']} | {s['status']} | {s['seconds']} | {s.get('detail', '').replace('|', '/')} |" for s in steps
    ]
    lines += [
        "",
        f"Ran: {', '.join(s['step'] for s in ran) or 'nothing'}.",
        f"Skipped: {'; '.join(s['step'] + ' (' + s['status'] + ')' for s in skipped) or 'nothing'}.",
        f"Results written to {results}: {', '.join(written) or 'none'}.",
        f"Logs: {b.out / 'logs'}.",
        "",
    ]
    count = len([p for p in results.iterdir() if p.is_file()]) if results.exists() else 0
    if results.resolve() == RESULTS.resolve() and count > 40:
        lines.append(f"**benchmarks/results holds {count} files, more than 40: fold or drop old ones.**")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default: 540)")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or "/tmp/hostir-gpu-bench",
        help="logs and the tools' own outputs (default: $OUT, else /tmp/hostir-gpu-bench)",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}, run in that order")
    ap.add_argument("--before", default=None, help="an older checkout of the repository: host overhead before")
    ap.add_argument("--build", action="store_true", help="build hostir._C in this tree (and --before) first")
    ap.add_argument("--probe", default=".probe/probe3_x2.py", help="the hand-written rings (default: %(default)s)")
    ap.add_argument(
        "--results", default=None, help="where result files go (default: benchmarks/results; with --cpu, OUT/results)"
    )
    ap.add_argument("--cpu", action="store_true", help="the small form: 2 gloo ranks on the CPU, small shapes")
    ap.add_argument("--ranks", type=int, default=2, help="ranks (GPUs) every part runs on (default: 2)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}: expected some of {PARTS}")
    if args.budget <= 0:
        ap.error("--budget must be positive")
    if args.before and not (pathlib.Path(args.before) / "python" / "hostir").is_dir():
        ap.error(f"--before {args.before}: not a checkout of hostir (no python/hostir in it)")
    return args


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def gpu_names(cpu: bool) -> list[str]:
    if cpu:
        return []
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def main(argv=None) -> int:
    args = parse_args(argv)
    gpus = gpu_names(args.cpu)
    if not args.cpu and len(gpus) < max(2, args.ranks):
        print(
            f"gpu_bench: {len(gpus)} CUDA device(s) visible; it needs {max(2, args.ranks)} (or --cpu for the small "
            f"form)",
            file=sys.stderr,
        )
        return 2
    b = Bench(args, gpus)
    results = pathlib.Path(args.results) if args.results else (b.out / "results" if args.cpu else RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    print(
        f"gpu_bench: {b.machine()}, budget {args.budget:.0f} s, parts {', '.join(args.parts)}; logs in "
        f"{b.out / 'logs'}",
        flush=True,
    )
    # Ended from outside (the caller's own time limit): the running step's
    # process group is ended (Runner.step), the results so far written.
    signal.signal(signal.SIGTERM, _interrupt)
    interrupted = False
    for part in (["build"] if args.build else []) + [p for p in PARTS if p in args.parts]:
        try:
            globals()[f"part_{part}"](b)
        except KeyboardInterrupt as why:
            b.run.skip(part, f"interrupted ({why or 'Ctrl-C'}); the parts after it did not run")
            interrupted = True
            break
        except Exception as exc:  # one part's driver failing leaves the others their turn
            b.run.skip(part, f"its driver failed: {type(exc).__name__}: {exc}")
    written = compose(b, results)
    index(results, written, b.machine())
    copies = b.out / "results"
    if results.resolve() != copies.resolve():
        # The files written, and the index, beside the logs: --out is what a
        # caller takes back from the machine.
        copies.mkdir(parents=True, exist_ok=True)
        for name in [name for name, _ in written] + ["README.md"]:
            if (results / name).exists():
                shutil.copyfile(results / name, copies / name)
    text = summary(b, [name for name, _ in written], results)
    (b.out / "gpu_bench_summary.md").write_text(text)
    print(text, flush=True)
    ok = all(s["status"] == "passed" or s["status"].startswith("skipped") for s in b.run.steps)
    return 0 if ok and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
