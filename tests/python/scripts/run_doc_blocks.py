"""Run the code blocks of one documentation page that belong to one launch
(`cpu` or `mpirun-N`), in order, in one namespace, and write each block's
standard output to OUT/rank<R>.json. Started by tests/python/test_docs.py,
alone or under mpirun; the convention is in tests/python/doc_blocks.py.

    python tests/python/scripts/run_doc_blocks.py PAGE LAUNCH OUT
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from doc_blocks import blocks  # noqa: E402


def main() -> int:
    page, launch, out = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    namespace: dict[str, object] = {"__name__": "__main__"}
    results = []
    for block in blocks(page):
        if block.launch != launch:
            continue
        captured = io.StringIO()
        code = compile("\n" * (block.line) + block.code, str(page), "exec")  # tracebacks name the page's lines
        try:
            with contextlib.redirect_stdout(captured):
                exec(code, namespace)
        except BaseException:
            sys.stderr.write(f"[rank {rank}] the block at {block.where} failed; it printed:\n{captured.getvalue()}")
            traceback.print_exc()
            return 1
        results.append({"line": block.line, "stdout": captured.getvalue()})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
