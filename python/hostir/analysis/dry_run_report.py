"""The dry run's report: what each rank posted (`Transfer`), the buffers it
held (`Buffer`), one rank's record (`RankReport`) and every rank's
(`DryRunReport`), and their text (`format_report`)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter


import torch


# ---------------------------------------------------------------- records


@dataclasses.dataclass
class Transfer:
    """One posted communication on one rank."""

    rank: int
    kind: str  # a CommunicationType's name, or "send" / "recv"
    team: tuple
    root: int | None
    red_op: str | None
    line: str
    loops: list
    stream: str
    dtype: str
    input_bytes: int
    output_bytes: int
    sent: dict
    received: dict
    waited: bool = False
    # What the transport holds while the communication is in flight, beyond
    # the program's buffers: its staging buffers and the backend's scratch.
    staging_bytes: int = 0

    def where(self) -> str:
        loops = "".join(f" (in loop {name} = {value})" for name, value in self.loops)
        return f"rank {self.rank}: {self.line}{loops}"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["team"] = list(self.team)
        d["loops"] = [{"index": n, "value": v} for n, v in self.loops]
        d["sent"] = {str(k): v for k, v in self.sent.items()}
        d["received"] = {str(k): v for k, v in self.received.items()}
        return d


@dataclasses.dataclass
class Buffer:
    """A tensor the program allocated (an Allocate, or an op's fresh result)."""

    name: str
    bytes: int
    shape: list
    dtype: str
    stream: str
    line: str
    loops: list

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["loops"] = [{"index": n, "value": v} for n, v in self.loops]
        return d


@dataclasses.dataclass
class RankReport:
    rank: int
    outputs: list  # (name, shape or None, dtype)
    inputs: list  # (name, shape, dtype)
    buffers: list
    peak_bytes: int
    peak_at: str
    peak_by_stream: dict
    communications: list
    ops_executed: dict
    # What the backend's post of a communication raised (see `check_posts`).
    post_errors: list = dataclasses.field(default_factory=list)
    # Host memory apart from the device's: `peak_bytes` is the device's.
    host_peak_bytes: int = 0
    # Each transfer between host and device memory: direction, bytes, line.
    transfers: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "inputs": [{"name": n, "shape": s, "dtype": d} for n, s, d in self.inputs],
            "outputs": [{"name": n, "shape": s, "dtype": d} for n, s, d in self.outputs],
            "memory": {
                "buffers": [b.as_dict() for b in self.buffers],
                "peak_bytes": self.peak_bytes,
                "peak_at": self.peak_at,
                "peak_by_stream": dict(self.peak_by_stream),
                "host_peak_bytes": self.host_peak_bytes,
            },
            "communications": [t.as_dict() for t in self.communications],
            "transfers": [dict(t) for t in self.transfers],
            "ops_executed": dict(self.ops_executed),
        }

    def bytes_sent(self) -> dict:
        total: Counter = Counter()
        for t in self.communications:
            total.update(t.sent)
        return dict(total)

    def bytes_received(self) -> dict:
        total: Counter = Counter()
        for t in self.communications:
            total.update(t.received)
        return dict(total)


@dataclasses.dataclass
class DryRunReport:
    """What every rank's program does, found without running it."""

    world_size: int
    number_of_streams: int
    ranks: list

    def __getitem__(self, rank: int) -> RankReport:
        return self.ranks[rank]

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "number_of_streams": self.number_of_streams,
            "ranks": [r.as_dict() for r in self.ranks],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.as_dict(), **kwargs)

    def __str__(self) -> str:
        return format_report(self)


def _team(team) -> str:
    return "(" + " ".join(map(str, team)) + ")"


# ---------------------------------------------------------------- printing


_TENSOR = re.compile(r"(T\d+)_[glsh]_\w+\[[^\]]*\](?: \(DeviceMesh\{[^()]*\}\))?")


def short(line: str) -> str:
    """A dump line with each tensor written by its name alone."""
    return " ".join(_TENSOR.sub(r"\1", line).split())


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} B)"
    return f"{n} B"


def _per_peer(t: Transfer, counts: dict, verb: str, prep: str) -> str:
    if not counts:
        return ""
    sizes = set(counts.values())
    others = set(t.team) - {t.rank}
    if len(sizes) == 1 and len(counts) > 1:
        return f"{verb} {_bytes(sizes.pop())} {prep} each of {len(counts)} peers"
    if len(sizes) == 1 and set(counts) == others:
        # Written without the peer's number, so ranks that differ only in
        # it print as one group.
        return f"{verb} {_bytes(sizes.pop())} {prep} the other team member"
    return f"{verb} " + ", ".join(f"{_bytes(n)} {prep} rank {p}" for p, n in sorted(counts.items()))


def _rank_body(r: RankReport) -> list[str]:
    lines = []
    outs = ", ".join(f"{n} {d}{s}" if s is not None else f"{n} (not held)" for n, s, d in r.outputs)
    lines.append(f"  outputs: {outs}")
    lines.append(f"  memory: peak {_bytes(r.peak_bytes)} after {short(r.peak_at)}")
    if r.host_peak_bytes or r.transfers:
        lines.append(f"    host memory: peak {_bytes(r.host_peak_bytes)} (apart from the device's)")
    if r.peak_by_stream:
        per = ", ".join(f"{s} {_bytes(n)}" for s, n in sorted(r.peak_by_stream.items()))
        lines.append(f"    peak per stream: {per}")
    seen: Counter = Counter()
    first: dict = {}
    for b in r.buffers:
        key = (b.name, b.bytes, b.stream if not b.loops else "", b.line)
        seen[key] += 1
        first.setdefault(key, b)
    if seen:
        lines.append("    buffers:")
    for key, count in seen.items():
        b = first[key]
        times = f" x{count} (one per iteration)" if count > 1 else ""
        lines.append(f"      {b.name} {b.dtype}{b.shape} {_bytes(b.bytes)} on {b.stream}{times}")
    lines.append(f"  communications: {len(r.communications)}")
    for t in r.communications:
        loops = "".join(f" [{n}={v}]" for n, v in t.loops)
        traffic = "; ".join(
            x for x in (_per_peer(t, t.sent, "sends", "to"), _per_peer(t, t.received, "receives", "from")) if x
        )
        sizes = f"input {_bytes(t.input_bytes)}, output {_bytes(t.output_bytes)}"
        if t.staging_bytes:
            sizes += f", staging {_bytes(t.staging_bytes)}"
        lines.append(f"    {t.kind} team={_team(t.team)}{loops} on {t.stream} ({sizes}): {traffic or 'no traffic'}")
    if r.transfers:
        moved = Counter()
        for t in r.transfers:
            moved[t["direction"]] += t["bytes"]
        per = ", ".join(f"{d} {_bytes(n)}" for d, n in sorted(moved.items()))
        lines.append(f"  transfers: {len(r.transfers)} ({per})")
    sent, received = sum(r.bytes_sent().values()), sum(r.bytes_received().values())
    lines.append(f"    total: sends {_bytes(sent)}, receives {_bytes(received)}")
    ops = ", ".join(f"{k} {v}" for k, v in sorted(r.ops_executed.items()))
    lines.append(f"  ops executed: {sum(r.ops_executed.values())} ({ops})")
    return lines


def format_report(report: DryRunReport) -> str:
    """The report as text; ranks whose reports read the same are printed once."""
    head = (
        f"Dry run of {report.world_size} rank{'s' if report.world_size > 1 else ''}, {report.number_of_streams} streams"
    )
    lines = [head]
    if report.ranks:
        ins = ", ".join(f"{n} {d}{s}" for n, s, d in report.ranks[0].inputs)
        lines.append(f"inputs (each rank's piece): {ins}")
    groups: dict[tuple, list[int]] = {}
    for r in report.ranks:
        groups.setdefault(tuple(_rank_body(r)), []).append(r.rank)
    for body, ranks in groups.items():
        lines.append(f"{_rank_list(ranks)}:")
        lines.extend(body)
    return "\n".join(lines) + "\n"


def _rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
