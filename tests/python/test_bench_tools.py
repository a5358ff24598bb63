"""The benchmark drivers in tools/ run in their small CPU forms:
`bench_training.py --cpu` under mpirun (both plans, 2 gloo ranks), and
`gpu_bench.py`: its arguments, its parts in priority order within the
budget, the result files and the index it writes, and one real part."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys

import pytest

from launchers import job_env, run_job
from spawn import free_port
from test_multidevice_mpirun import mpirun_command, requires_mpirun

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import gpu_bench  # noqa: E402


@requires_mpirun
@pytest.mark.timeout(200)
def test_bench_training_cpu_form_runs_both_plans(tmp_path):
    exports = {"HOSTIR_MASTER_PORT": str(free_port()), "HOSTIR_TIMEOUT": "60", "PYTHONPATH": job_env()["PYTHONPATH"]}
    program = [sys.executable, "tools/bench_training.py", "--cpu", "--plans", "tp,sp", "--out-dir", str(tmp_path)]
    returncode, output, elapsed = run_job(mpirun_command(2, program, exports), 180)
    assert returncode == 0, f"exit {returncode} after {elapsed:.0f} s:\n{output[-4000:]}"
    text = (tmp_path / "bench_training_cpu_ws2.md").read_text()
    for plan in ("tp", "sp"):
        for kind in ("mlp", "attn_proj"):
            for variant in ("hostir.parallel", "torch TP"):
                row = re.search(rf"^\| {plan} \| {kind} \| {re.escape(variant)} \| (\S+) \|", text, re.M)
                assert row and row.group(1) != "—", f"{plan} {kind} {variant} has no time:\n{text}"
            assert re.search(rf"^\| {plan} \| {kind} \| torch async-TP \|.*skipped: .*CUDA", text, re.M), text
    assert "skipped: torch async-TP needs" in output


def test_gpu_bench_refuses_unknown_parts_and_a_before_that_is_no_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--cpu", "--parts", "overlap_ag,bogus"])
    assert "bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--cpu", "--before", str(tmp_path)])
    assert "not a checkout" in capsys.readouterr().err


def test_gpu_bench_runs_parts_in_priority_order_and_skips_what_the_budget_leaves_out(tmp_path, monkeypatch):
    # Every part's command sleeps 1 s; a budget of 20.5 s leaves the first part
    # its minimum (15 s, 5 s kept back) and too little to the rest.
    monkeypatch.setattr(
        gpu_bench.Bench, "launch", lambda self, n, program: [sys.executable, "-c", "import time; time.sleep(1)"]
    )
    code = gpu_bench.main(["--cpu", "--budget", "20.5", "--out", str(tmp_path), "--parts", "training,overlap_rs,sweep"])
    assert code == 0
    summary = (tmp_path / "gpu_bench_summary.md").read_text()
    steps = re.findall(r"^\| (\w+) \| ([^|]+) \|", summary, re.M)[1:]
    assert [name for name, _ in steps] == ["overlap_rs", "training_np2", "sweep"], summary
    assert steps[0][1].strip() == "passed", summary
    assert all("skipped: no time left" in status for _, status in steps[1:]), summary
    assert "Skipped: training_np2" in summary


def fake_outputs(out: pathlib.Path) -> None:
    (out / "overlap").mkdir(parents=True)
    (out / "overlap" / "bench_overlap_ag.md").write_text("# AG+matmul overlap, 2 ranks\n\n| variant | ms |\n")
    (out / "probe3").mkdir()
    probe = {
        "info": {"device": "GPU"},
        "base": {"g": {"gemm": 1.0, "seq": 2.0, "symm": 1.5}},
        "rows": [{"group": "g", "name": "P2 ce_ring c=1 sm, graph", "ms": 1.25, "host": 0.1, "check": "close"}],
    }
    (out / "probe3" / "probe3_x2_results.json").write_text(json.dumps(probe))
    for label, us in (("after_1", 100.0), ("before_1", 200.0), ("before_2", 220.0), ("after_2", 110.0)):
        (out / "host" / label).mkdir(parents=True)
        run = {
            "ranks": 2,
            "transport": "cuda",
            "communicator": "nccl",
            "steps": "mailbox",
            "device": "GPU",
            "torch": "2",
            "results": [{"variant": "multi-device, check_ranks=always", "median_us": us}],
        }
        (out / "host" / label / "host_overhead_multidevice_cuda_np2.json").write_text(json.dumps(run))
        (out / "host" / label / "host_overhead_multidevice_cuda_np2.md").write_text("# host\n")
        per_op = {"device": "GPU", "torch": "2", "results": [{"variant": "cpp flat", "median_us": us / 10}]}
        (out / "host" / label / "host_overhead_cuda.json").write_text(json.dumps(per_op))
    (out / "training").mkdir()
    (out / "training" / "bench_training_np2.md").write_text("# bench_training\n\n| plan | layer |\n")


def test_gpu_bench_writes_one_file_per_benchmark_and_keeps_the_index_true(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    fake_outputs(out)
    results.mkdir()
    shutil.copy(REPO / "benchmarks" / "results" / "README.md", results / "README.md")
    args = gpu_bench.parse_args(["--cpu", "--out", str(out)])
    bench = gpu_bench.Bench(args, ["NVIDIA H100 80GB HBM3"] * 2)
    bench.cpu, bench.tag = False, "h100x2"
    written = gpu_bench.compose(bench, results)
    assert [name for name, _ in written] == [
        "overlap_h100x2.md",
        "host_overhead_before_after_h100x2.md",
        "training_h100x2.md",
    ]
    overlap = (results / "overlap_h100x2.md").read_text()
    assert "## AG+matmul overlap" in overlap
    # The probe's row with its own ratios: 1.25 / gemm 1.0, sequential 2.0 / 1.25, symm_mem 1.5 / 1.25.
    assert "| g | P2 ce_ring c=1 sm, graph | 1.250 | 1.250 | 1.600 | 1.200 | 0.100 | close |" in overlap
    host = (results / "host_overhead_before_after_h100x2.md").read_text()
    assert "| multi-device, check_ranks=always | 105.0 | 210.0 | 0.50 |" in host
    assert "| cpp flat | 10.5 | 21.0 | 0.50 |" in host
    gpu_bench.index(results, written, "2 × H100")
    readme = (results / "README.md").read_text()
    for name, _ in written:
        assert readme.count(f"| [{name}]({name}) |") == 1
    assert readme.rstrip().splitlines()[-1].startswith("| README.md |")
    gpu_bench.index(results, written, "2 × H100")  # a second run replaces its rows
    assert (results / "README.md").read_text() == readme


def test_gpu_bench_llama_part_cuts_fc1_and_fc2_over_the_ranks_and_joins_the_overlap_file(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    results.mkdir()
    args = gpu_bench.parse_args(["--cpu", "--out", str(out), "--ranks", "4"])
    bench = gpu_bench.Bench(args, ["NVIDIA H100 80GB HBM3"] * 4)
    bench.cpu, bench.tag = False, "h100x4"
    # FC1: a rank's tokens gathered, its quarter of the intermediate's columns;
    # FC2: every rank's tokens, its quarter of the intermediate's rows, summed and scattered.
    assert gpu_bench.llama_shapes(bench) == [
        ("ag", "llama_fc1_t4096", (4096, 8192, 7168)),
        ("rs", "llama_fc2_t4096", (16384, 7168, 8192)),
        ("ag", "llama_fc1_t8192", (8192, 8192, 7168)),
        ("rs", "llama_fc2_t8192", (32768, 7168, 8192)),
    ]
    (out / "llama").mkdir(parents=True)
    (out / "llama" / "bench_overlap_llama_fc2_t8192.md").write_text("# matmul+RS overlap, 4 ranks\n\n| variant |\n")
    written = gpu_bench.compose(bench, results)
    assert [name for name, _ in written] == ["overlap_h100x4.md"]
    overlap = (results / "overlap_h100x4.md").read_text()
    assert "## Llama-70B's projections (hidden 8192, intermediate 28672)" in overlap
    assert "### matmul+RS overlap, 4 ranks" in overlap


@pytest.mark.timeout(120)
def test_gpu_bench_cpu_form_runs_a_part_and_writes_its_result(tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable,
        "tools/gpu_bench.py",
        "--cpu",
        "--budget",
        "55",
        "--parts",
        "overlap_rs,probe3",
        "--out",
        str(out),
    ]
    returncode, output, elapsed = run_job(command, 90)
    assert returncode == 0, f"exit {returncode} after {elapsed:.0f} s:\n{output[-4000:]}"
    text = (out / "results" / "overlap_cpu.md").read_text()
    assert "matmul+RS overlap" in text and "| sequential |" in text
    assert re.search(r"probe3: skipped, .*(missing|need CUDA)", output), output[-2000:]
