"""`python -m hostir.plan`: a user's multi-device script planned for D ranks
on one CPU process, without a launcher or a process group."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import hostir
from hostir import plan

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "sequence_parallel_matmul.py")


def test_plans_the_sequence_parallel_example_for_8_ranks(capsys):
    assert plan.main([EXAMPLE, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Dry run of 8 ranks, 2 streams\n")
    assert "ranks 0-7:" in out
    assert "outputs: T3 float32[4, 8, 8, 32]" in out
    assert out.count("Allgather team=(0 1 2 3 4 5 6 7)") == 4
    assert "sends 2048 B to each of 7 peers" in out
    assert hostir.communicator.live() is None


def test_json_report_and_another_rank(capsys):
    assert plan.main([EXAMPLE, "--world-size", "4", "--rank", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert data["ranks"][3]["outputs"][0]["shape"] == [4, 4, 8, 32]


def test_script_that_never_executes_is_exit_2(tmp_path, capsys):
    script = tmp_path / "nothing.py"
    script.write_text("print('hello')\n")
    assert plan.main([str(script), "--world-size", "2"]) == 2
    assert "finished without executing a fusion" in capsys.readouterr().err


def test_dry_run_error_is_printed_with_exit_1(tmp_path, capsys):
    script = tmp_path / "bad.py"
    script.write_text(
        "import torch, hostir\n"
        "from hostir import DeviceMesh, FusionDefinition, ParallelType\n"
        "with FusionDefinition() as fd:\n"
        "    x = fd.define_tensor(shape=[4, -1])\n"
        "    y = fd.ops.set(x)\n"
        "    fd.add_output(y)\n"
        "for tv in (x, y):\n"
        "    tv.set_device_mesh(DeviceMesh(range(4)))\n"
        "x.axis(0).parallelize(ParallelType.mesh_x)\n"
        "fd.execute([torch.randn(1, 3)])\n"
    )
    assert plan.main([str(script), "--world-size", "2"]) == 1
    assert "DryRunError: rank 0: " in capsys.readouterr().err


def test_runs_as_a_module():
    env_path = str(REPO / "python")
    proc = subprocess.run(
        [sys.executable, "-m", "hostir.plan", EXAMPLE, "--world-size", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Dry run of 2 ranks" in proc.stdout and "ranks 0-1:" in proc.stdout
