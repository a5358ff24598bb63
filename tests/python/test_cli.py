"""The `hostir` command line: dump, run, env, plan, and their --help."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import re

import pytest

from hostir import cli, communicator
from launchers import job_env as mpirun_env
from test_multidevice_mpirun import requires_mpirun

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "sequence_parallel_matmul.py")


def hostir_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = mpirun_env() if env is None else env
    return subprocess.run(
        [sys.executable, "-m", "hostir", *args], cwd=REPO, env=base, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("command", ["dump", "run", "env", "machine"])
def test_each_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hostir {command}")


def test_python_m_hostir_help():
    result = hostir_cli("--help")
    assert result.returncode == 0, result.stderr
    for command in ("dump", "run", "env", "plan"):
        assert command in result.stdout


def test_dump_prints_a_ranks_program_without_running_it(capsys):
    assert cli.main(["dump", EXAMPLE, "--rank", "1", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"# {EXAMPLE}: host program, rank 1 of 2"
    assert lines[1].startswith("%HostIrContainer {") and "(DeviceMesh{0 1})" in lines[1]
    assert any("Communication 0 (type=Allgather, team=(0 1)" in line for line in lines), out
    assert "matches eager torch" not in out  # the script stopped at its execute
    assert communicator.live() is None  # no process group was made
    assert "RANK" not in os.environ


# A script every rank of a job runs: it makes the default group itself,
# builds a torch mesh and parallelizes a block with hostir.parallel.
TORCH_MESH_SCRIPT = """
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import hostir
from hostir.parallel import parallelize_module

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (hostir.world_size(),))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
print("ran past its execute", model(torch.randn(4, 16)).shape)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    "command, expected",
    [
        # The colwise Linear, its weight sharded on the mesh.
        (["dump"], "= linear( T0_g_float[iS0{i0}, iS1{i1}] (DeviceMesh{0 1}), T1_g_float[ideviceIdx.x10{2}"),
        # Each rank's half of the colwise weight and of its output.
        (["plan"], "T1 float32[16, 16], T2 float32[16]\nranks 0-1:\n  outputs: T3 float32[4, 16]\n"),
    ],
)
def test_dump_and_plan_of_a_script_with_a_torch_mesh_start_no_rendezvous(tmp_path, command, expected):
    # The script's mesh has fake peers: the commands print at once, where
    # a rendezvous would wait for a rank 1 that never comes.
    script = tmp_path / "torch_mesh.py"
    script.write_text(TORCH_MESH_SCRIPT)
    env = dict(mpirun_env(), HOSTIR_TIMEOUT="600", PYTHONPATH=str(REPO / "python"))
    result = hostir_cli(*command, str(script), "--world-size", "2", env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout, result.stdout
    assert "ran past its execute" not in result.stdout


def test_dump_after_a_pass(capsys):
    assert cli.main(["dump", EXAMPLE, "--world-size", "2", "--pass", "parallelize_streams"]) == 0
    out = capsys.readouterr().out
    assert "after pass parallelize_streams" in out
    assert "FOR StreamIdx" in out and "Communication" not in out  # communications come later
    assert "(on worker streams" in out and "SetCurrentStream" not in out  # streams come one pass later


def test_dump_after_assign_streams(capsys):
    assert cli.main(["dump", EXAMPLE, "--world-size", "2", "--pass", "assign_streams"]) == 0
    out = capsys.readouterr().out
    assert "after pass assign_streams" in out
    assert "SetCurrentStream" in out and "on worker streams" not in out and "Communication" not in out


def test_dump_rejects_unknown_pass_and_bad_rank():
    from hostir.lower import PIPELINE

    names = ", ".join(["build_host_program"] + [p.__name__ for p in PIPELINE])
    with pytest.raises(SystemExit, match=re.escape(f"unknown pass 'nope'; passes in order: {names}")):
        cli.main(["dump", EXAMPLE, "--pass", "nope"])
    with pytest.raises(SystemExit, match="--rank 2 is out of range for --world-size 2"):
        cli.main(["dump", EXAMPLE, "--rank", "2", "--world-size", "2"])


def test_dump_of_a_script_without_execute(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="ran to its end without calling fd.execute"):
        cli.main(["dump", str(script)])


@pytest.mark.parametrize("launcher, head", [
    ("mpirun", ["mpirun", "-np", "3", "--oversubscribe"]),
    ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]),
    ("srun", ["srun", "--ntasks", "3"]),
])
def test_run_commands(launcher, head):
    command, exports = cli.launch_command(launcher, 3, "s.py", ["--x", "1"], "10.0.0.1", 29999)
    assert command[: len(head)] == head
    assert command[-3:] == ["s.py", "--x", "1"]
    assert exports["HOSTIR_MASTER_ADDR"] == "10.0.0.1"
    if launcher == "mpirun":
        assert "HOSTIR_MASTER_PORT=29999" in command[command.index("-x", 4) + 1 :][2]
    if launcher == "torchrun":
        assert command[command.index("--master-port") + 1] == "29999"
        assert exports["HOSTIR_MASTER_PORT"] != "29999"  # torchrun's store holds that one
    else:
        assert exports["HOSTIR_MASTER_PORT"] == "29999"


def test_run_dry_run_prints_an_mpirun_command_that_runs_as_printed(monkeypatch, capsys):
    # Open MPI refuses root without its two variables: the printed command
    # carries them, as the command `hostir run` itself starts does.
    monkeypatch.setattr(cli.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    assert cli.main(["run", "--launcher", "mpirun", "--dry-run", "-n", "2", "s.py"]) == 0
    printed = capsys.readouterr().out
    assert "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2" in printed, printed


def test_plan_help_names_the_hostir_command(capsys):
    assert cli.main(["plan", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: hostir plan")


def test_run_picks_srun_inside_slurm_only_when_srun_exists(monkeypatch):
    monkeypatch.setattr(cli.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert cli.pick_launcher("auto", {"SLURM_JOB_ID": "7"}) == "srun"
    assert cli.pick_launcher("auto", {}) == "mpirun"
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    assert cli.pick_launcher("auto", {"SLURM_JOB_ID": "7"}) == "torchrun"
    assert cli.pick_launcher("mpirun", {}) == "mpirun"


@requires_mpirun
@pytest.mark.timeout(150)
def test_run_starts_ranks_with_a_rendezvous(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(
        "import os, hostir\n"
        "print(f'rank {hostir.rank()} of {hostir.world_size()} port {os.environ[\"HOSTIR_MASTER_PORT\"]}')\n"
    )
    result = hostir_cli("run", "-n", "2", "--launcher", "mpirun", str(script), timeout=140)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(" port ")[0] for line in lines] == ["rank 0 of 2", "rank 1 of 2"]
    assert len({line.split(" port ")[1] for line in lines}) == 1


def test_env_reports_the_launch():
    env = dict(mpirun_env(), RANK="1", WORLD_SIZE="4", LOCAL_RANK="1")
    result = hostir_cli("env", "--json", env=env)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["process"] == {"rank": 1, "world_size": 4, "local_rank": 1, "source": "torchrun"}
    assert info["launcher_variables"] == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert info["backend"] in ("gloo", "nccl")
    assert info["extension"] in ("built", "not built")
    assert info["versions"]["hostir"] and info["versions"]["torch"]
    assert isinstance(info["p2p_access"], list)


def test_env_names_a_broken_launch():
    env = dict(mpirun_env(), RANK="1")
    result = hostir_cli("env", env=env)
    assert result.returncode == 0, result.stderr
    assert "incomplete torchrun variables: WORLD_SIZE missing" in result.stdout
