"""The documentation site builds, and every code block in it runs.

`mkdocs build --strict` must pass (broken links, missing pages and
docstrings that mkdocstrings cannot read are errors). Each page's ```python
blocks run on the CPU in one fresh process, the blocks marked
`<!-- docs: mpirun -np N -->` under Open MPI's `mpirun -np N` with gloo,
and the shell blocks marked `<!-- docs: run -->` with bash; every
`<!-- docs: output -->` block must equal what its block printed, up to
numbering. The convention is in doc_blocks.py and docs/writing-docs.md.
The environment-variable and error pages must name every variable hostir
reads and every error class it defines.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import hostir
from doc_blocks import Block, blocks, normalize
from launchers import MPIRUN, REPO, job_env, open_mpi_command, run_job
from spawn import free_port

DOCS = REPO / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), REPO / "README.md"]
RUNNER = REPO / "tests" / "python" / "scripts" / "run_doc_blocks.py"


def _launches() -> list[tuple[pathlib.Path, str]]:
    found = []
    for page in PAGES:
        for launch in dict.fromkeys(b.launch for b in blocks(page) if b.launch in ("cpu",) or (b.launch or "").startswith("mpirun-")):
            found.append((page, launch))
    return found


def _env() -> dict[str, str]:
    env = job_env()
    env["HOSTIR_TIMEOUT"] = "60"
    env["HOSTIR_MASTER_PORT"] = str(free_port())
    # The blocks' programs print the host program themselves; a user's own
    # dump settings would add to what they print.
    for name in ("HOSTIR_DUMP", "NVFUSER_DUMP", "HOSTIR_TRACE", "HOSTIR_FAKE", "HOSTIR_LOG"):
        env.pop(name, None)
    return env


def _check_outputs(page: pathlib.Path, launch: str, printed: list[dict]) -> None:
    page_blocks = blocks(page)
    by_line = {r["line"]: r["stdout"] for r in printed}
    for block in reversed(page_blocks):  # a rewrite leaves the lines above it in place
        if block.output_of is None:
            continue
        source = page_blocks[block.output_of]
        if source.launch != launch:
            continue
        assert source.line in by_line, f"{source.where} did not run"
        _compare(block, source, by_line[source.line])


def _compare(shown: Block, source: Block, printed: str) -> None:
    """`shown` must be what `source` printed, up to numbering; with
    HOSTIR_ACCEPT=1 a differing block is rewritten instead (as the golden
    dumps are)."""
    if normalize(printed) == normalize(shown.code):
        return
    if os.environ.get("HOSTIR_ACCEPT") == "1":
        lines = shown.page.read_text().splitlines(keepends=True)
        lines[shown.line : shown.line + shown.length] = [line.rstrip() + "\n" for line in printed.strip("\n").splitlines()]
        shown.page.write_text("".join(lines))
        return
    raise AssertionError(f"{shown.where}: the output shown is not what {source.where} prints (up to numbering); it prints:\n{printed}")


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO / "python")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("FusionDefinition") > 3


@pytest.mark.timeout(420)
@pytest.mark.parametrize("page, launch", _launches(), ids=[f"{p.stem}-{launch}" for p, launch in _launches()])
def test_code_blocks_run(page, launch, tmp_path):
    out = tmp_path / "out"
    program = [sys.executable, str(RUNNER), str(page), launch, str(out)]
    if launch == "cpu":
        command, nprocs = program, 1
    else:
        assert MPIRUN is not None, "mpirun is not on PATH: the set-up command installs Open MPI (the test extra)"
        nprocs = int(launch.split("-")[1])
        command = open_mpi_command(nprocs, program, {"HOSTIR_TIMEOUT": "60", "HOSTIR_MASTER_PORT": str(free_port())})
    returncode, output, elapsed = run_job(command, 360, env=_env())
    assert returncode is not None, f"{page.name} ({launch}) did not finish within 360 s:\n{output[-6000:]}"
    assert returncode == 0, f"{page.name} ({launch}) failed:\n{output[-8000:]}"
    ranks = sorted(out.glob("rank*.json"))
    assert len(ranks) == nprocs, f"expected {nprocs} ranks' outputs, got {[r.name for r in ranks]}:\n{output[-4000:]}"
    _check_outputs(page, launch, json.loads((out / "rank0.json").read_text()))


def _shell_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.launch == "bash"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _shell_blocks(), ids=[b.where for b in _shell_blocks()])
def test_shell_blocks_run(block, tmp_path):
    env = _env()
    # The commands as a user types them: this interpreter's python3,
    # hostir and mpirun first on PATH; Open MPI may run as root in CI.
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TMPDIR=str(tmp_path))
    # What the block prints is its standard output; its standard error
    # (launchers' notices) is shown only when it fails.
    stderr = tmp_path / "stderr"
    script = f'exec 2>"{stderr}"; set -euo pipefail\n{block.code}'
    returncode, output, elapsed = run_job(["bash", "-c", script], 240, env=env)
    assert returncode == 0, f"{block.where} failed ({returncode}):\n{output[-4000:]}{stderr.read_text()[-6000:]}"
    page_blocks = blocks(block.page)
    index = next(i for i, b in enumerate(page_blocks) if b.line == block.line)
    for shown in reversed(page_blocks):
        if shown.output_of == index:
            _compare(shown, block, output)


# Names that look like variables but are not read from the environment.
_NOT_VARIABLES = {"HOSTIR_KINDS", "HOSTIR_STREAMS"}


def test_every_environment_variable_is_documented():
    """Every HOSTIR_* name the code reads (a quoted string in the package,
    tools/, setup.py or the tests) has a row in docs/environment.md."""
    used: set[str] = set()
    files = [*(REPO / "python").rglob("*.py"), *(REPO / "tools").glob("*"), REPO / "setup.py", *(REPO / "tests").rglob("*.py")]
    for path in files:
        if path.is_file():
            used |= set(re.findall(r"[\"'](HOSTIR_[A-Z0-9_]+)[\"']", path.read_text(errors="replace")))
    used -= _NOT_VARIABLES
    table = (DOCS / "environment.md").read_text()
    rows = set(re.findall(r"^\| `((?:HOSTIR|NVFUSER)_[A-Z0-9_]+)`", table, re.MULTILINE))
    assert used and used <= rows, f"undocumented in docs/environment.md: {sorted(used - rows)}"
    assert "NVFUSER_DUMP" in rows
    from hostir import options

    for option in options.DUMP_OPTIONS:
        assert f"`{option}`" in table, f"the dump option {option} is not in docs/environment.md"


def _error_classes() -> set[type]:
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(hostir.__path__, "hostir."):
        if info.name.startswith(("hostir.__main__", "hostir.plan")):
            continue
        importlib.import_module(info.name)
    found: set[type] = set()
    todo = [hostir.HostIrError]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return {c for c in found if c.__module__.startswith("hostir") and not c.__name__.startswith("_")}


def test_every_error_class_is_documented():
    text = (DOCS / "errors.md").read_text()
    missing = sorted(c.__name__ for c in _error_classes() if f"`{c.__name__}`" not in text)
    assert not missing, f"error classes docs/errors.md does not name: {missing}"
