"""Plan a multi-device job on one machine: `python -m hostir.plan script.py --world-size 8`.

The script is the one a user launches on every rank (under mpirun or
torchrun). It runs here once, as rank 0 (or `--rank`) of `--world-size`
ranks, with `HOSTIR_FAKE=1` so that nothing reaches a device or a process
group; its first `fd.execute` stops it, and the dry run of that fusion on
those inputs, for every rank, is printed (`--json` for JSON). Code after
that call (result checks on real data) does not run: the call raises
`ScriptStopped`. Arguments after `--` go to the script. Exit status 1 when
the dry run finds an error (it is printed), 2 for a script that never
executes a fusion.

A script that builds a torch mesh (`DeviceMesh.to_torch()`,
`init_device_mesh`, `parallelize_module`) runs in a world of fake peers
(`fake_world`): torch.distributed's default group is torch's `fake`
backend, whose collectives return at once, so no rendezvous waits for
ranks that are not there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import runpy
import sys
import unittest.mock
from collections.abc import Iterator

from hostir.communicator import LAUNCHER_VARIABLES
from hostir.errors import HostIrError
from hostir.analysis.dry_run import CommunicationMismatchError, DryRunError, dry_run
from hostir.executor import ExecutorParams, FusionExecutor
from hostir.runtime.checks import is_multi_device


@dataclasses.dataclass
class Captured:
    """The first execute of a script: its fusion's executor, inputs and
    parameters."""

    executor: FusionExecutor
    inputs: list
    params: ExecutorParams


class ScriptStopped(HostIrError, RuntimeError):
    """Raised by the execute calls of a planned script: the first one is
    captured, and the script is not to run further."""


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch.distributed as rank `rank` of `world_size` with no peer to wait
    for: a default group on torch's `fake` backend (its collectives return
    at once and move nothing), which torch meshes, `init_device_mesh` and
    `parallelize_module` use as they would a real one. A script's own
    `init_process_group` and `destroy_process_group` do nothing inside;
    the group is destroyed at the end. Where torch.distributed is already
    initialized (a launched job), it is left as it is."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    def kept(*args, **kwargs) -> None:
        return None

    try:
        with (
            unittest.mock.patch.object(dist, "init_process_group", kept),
            unittest.mock.patch.object(dist, "destroy_process_group", kept),
        ):
            yield
    finally:
        dist.destroy_process_group()


def capture_first_execute(script: str, args: list[str], world_size: int, rank: int) -> Captured | None:
    """Run `script` as rank `rank` of `world_size` until its first execute,
    which raises `ScriptStopped` (so do later ones, should the script catch
    it and go on)."""
    captured: list[Captured] = []

    def capture(executor, inputs, outputs=None, params=None, **kwargs):
        if not captured:
            captured.append(Captured(executor, inputs, ExecutorParams.from_arguments(params, kwargs)))
        raise ScriptStopped("hostir.plan captured the script's first execute")

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        HOSTIR_FAKE="1",
    )
    argv = [script] + list(args)
    with (
        unittest.mock.patch.dict(os.environ, env, clear=True),
        unittest.mock.patch.object(sys, "argv", argv),
        unittest.mock.patch.object(FusionExecutor, "execute", capture),
        fake_world(rank, world_size),
    ):
        try:
            runpy.run_path(script, run_name="__main__")
        except (ScriptStopped, SystemExit, Exception):
            # Whatever the script did once its execute was refused, the
            # capture is what is planned.
            if not captured:
                raise
    return captured[0] if captured else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hostir plan",
        description="Dry-run the fusion a script executes, for every rank, without a device or a launcher.",
    )
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks to plan for (default 1)")
    parser.add_argument("--rank", type=int, default=0, help="the rank the script runs as here (default 0)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    argv = sys.argv[1:] if argv is None else list(argv)
    script_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, script_args = argv[:at], argv[at + 1 :]
    ns = parser.parse_args(argv)
    if ns.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {ns.world_size}")
    if not 0 <= ns.rank < ns.world_size:
        parser.error(f"--rank {ns.rank} is out of range for --world-size {ns.world_size}")
    captured = capture_first_execute(ns.script, script_args, ns.world_size, ns.rank)
    if captured is None:
        print(f"{ns.script} finished without executing a fusion; nothing to plan", file=sys.stderr)
        return 2
    params = captured.params
    fusion = captured.executor.fusion
    world = ns.world_size if is_multi_device(fusion) else 1
    try:
        report = dry_run(fusion, captured.inputs, world_size=world, number_of_streams=params.number_of_streams)
    except (DryRunError, CommunicationMismatchError) as err:
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(report.to_json(indent=1) if ns.json else report, end="" if not ns.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
