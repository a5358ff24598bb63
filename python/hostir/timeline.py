"""Draw the stream timeline of one hostir run as a PNG (`tools/plot_timeline.py`).

Reads the per-rank traces a run wrote (`HOSTIR_TRACE=DIR` or
`fd.execute(..., trace=DIR)`: `DIR/hostir_trace_rank<R>.json`) and draws one
row per stream per rank, each host op a bar coloured by its kind (compute,
communication, copy, sync, host), so what overlapped is plain at a glance:
each communication also gets a framed bar in the lower half of its row,
from its posting to the end of its Wait. Times are
shifted so that the earliest event of the run is 0 (all ranks of one
machine share the clock). With several runs in a trace, `--run` picks one
(default: the last).

    python3 tools/plot_timeline.py DIR -o timeline.png [--run N] [--title T]

`save_timeline` traces one run of a fusion on every rank and draws it on
rank 0 (the overlap benchmark calls it once per variant). Needs matplotlib (`pip install 'hostir[plot]'`); without it the tool says so.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
from typing import Any

from hostir import communicator
from hostir.errors import HostIrError

class TraceError(HostIrError, ValueError):
    """The traces cannot be drawn: none found, no events, no such run."""


class TraceNotFoundError(TraceError, FileNotFoundError):
    """No trace files where a run should have written them."""


class PlotUnavailableError(HostIrError, RuntimeError):
    """matplotlib is not installed."""


COLOURS = {
    "compute": "#4c72b0",
    "communication": "#dd8452",
    "copy": "#55a868",
    "sync": "#c44e52",
    "host": "#b0b0b0",
}


def load(directory: str | pathlib.Path) -> list[dict[str, Any]]:
    """Every trace of `directory`, rank order."""
    paths = sorted(pathlib.Path(directory).glob("hostir_trace_rank*.json"))
    if not paths:
        raise TraceNotFoundError(f"no hostir_trace_rank*.json in {directory}")
    traces = [json.loads(p.read_text()) for p in paths]
    return sorted(traces, key=lambda t: t["otherData"]["rank"])


def rows(traces: list[dict[str, Any]], run: int | None = None) -> list[tuple[str, list[dict[str, Any]]]]:
    """(row label, events) per rank and stream of one run, times from 0 in µs."""
    chosen = []
    for trace in traces:
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        runs = sorted({e["args"].get("run", 0) for e in events})
        if not runs:
            continue
        pick = runs[-1] if run is None else run
        if pick not in runs:
            raise TraceError(f"rank {trace['otherData']['rank']} has runs {runs}, not {pick}")
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
        chosen.append((trace["otherData"]["rank"], names, [e for e in events if e["args"].get("run", 0) == pick]))
    if not chosen:
        raise TraceError("the traces hold no events")
    origin = min(e["ts"] for _, _, events in chosen for e in events)
    out = []
    for rank, names, events in chosen:
        for tid in sorted({e["tid"] for e in events}):
            mine = [dict(e, ts=e["ts"] - origin) for e in events if e["tid"] == tid]
            out.append((f"rank {rank} {names.get(tid, tid)}", mine))
    return out


def plot(directory: str | pathlib.Path, output: str | pathlib.Path, run: int | None = None, title: str | None = None) -> pathlib.Path:
    # Imported by name so that the types of this module (checked with
    # `mypy --strict`) do not depend on matplotlib being installed.
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
        Patch: Any = importlib.import_module("matplotlib.patches").Patch
    except ImportError:
        raise PlotUnavailableError("plot_timeline needs matplotlib: pip install 'hostir[plot]' (or matplotlib)") from None

    table = rows(load(directory), run)
    height = 1.4 + 0.45 * len(table)
    fig, ax = plt.subplots(figsize=(12, max(height, 2.0)))
    for y, (_, events) in enumerate(table):
        base = len(table) - 1 - y
        for e in events:
            kind = e["args"].get("kind", "host")
            # A communication's posted-to-Wait span gets the lower band of
            # its row, the ops the upper one, so what ran under it shows.
            posted = e["args"].get("posted_to_wait", False)
            band = (base - 0.42, 0.3) if posted else (base - 0.08, 0.5)
            ax.broken_barh(
                [(e["ts"] / 1000.0, max(e["dur"], 0.5) / 1000.0)],
                band,
                facecolors=COLOURS.get(kind, COLOURS["host"]),
                edgecolors="black" if posted else "none",
                linewidth=0.3,
            )
    ax.set_yticks(range(len(table)))
    ax.set_yticklabels([label for label, _ in reversed(table)])
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center", bbox_to_anchor=(0.5, -0.12 * 6 / max(height, 2.0)), fontsize=8, ncol=5, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = pathlib.Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def save_timeline(
    fd: Any,
    inputs: list[Any],
    directory: str | pathlib.Path,
    png: str | pathlib.Path | None = None,
    title: str | None = None,
    **execute_kwargs: Any,
) -> pathlib.Path | None:
    """Run `fd` once on `inputs` with a trace written to `directory` (one
    file per rank), then, once every rank has written its trace, draw it
    to `png` on rank 0 (if matplotlib is installed; else only the traces
    stay). Every rank calls it. Returns the PNG's path on rank 0, else None."""
    fd.execute(inputs, trace=directory, **execute_kwargs)
    comm = communicator.live()
    if comm is not None and comm.world_size > 1:
        comm.barrier()
    rank = comm.rank if comm is not None else 0
    if png is None or rank != 0 or not has_matplotlib():
        return None
    return plot(directory, png, None, title)


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw one hostir run's stream timeline as a PNG.")
    parser.add_argument("directory", help="where the run wrote hostir_trace_rank<R>.json")
    parser.add_argument("-o", "--output", default="timeline.png")
    parser.add_argument("--run", type=int, default=None, help="which run of the traces (default: the last)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        path = plot(args.directory, args.output, args.run, args.title)
    except HostIrError as err:
        sys.exit(f"plot_timeline: {err}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
