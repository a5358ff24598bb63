"""docs/training.md: its Python blocks run as written, in order, in one
process on the CPU (the multi-rank code lives in examples/)."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "training.md"


def test_training_page_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["parallelize_module"].__module__ == "hostir.parallel"
