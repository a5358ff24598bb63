"""ruff (pyflakes' rules and pycodestyle's import, statement and syntax
rules; pyproject.toml's [tool.ruff]) finds nothing in the package, the tests
and tools/: an undefined name is an error here, not a crash on the one path
that reaches it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_ruff_is_clean():
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "python/hostir", "tests", "tools", "examples"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, f"ruff check found problems:\n{found.stdout}{found.stderr}"
