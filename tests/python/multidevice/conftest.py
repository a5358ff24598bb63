"""Multi-device tests: every rank of an mpirun (or torchrun) job runs the
same tests in the same order.

Without a launcher (plain `python3 -m pytest`) the world has one rank and
every test here is skipped; `tests/python/test_multidevice_mpirun.py` runs
this directory under `mpirun -np 2`, `-np 3` and `-np 4`. By hand:

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        mpirun -np 2 --oversubscribe -x HOSTIR_MASTER_PORT=29517 \
        python3 -m pytest -q -p no:cacheprovider tests/python/multidevice --timeout=240

Nothing here runs a collective of its own (no barrier between tests): each
rank's tests talk to each other only through `fd.execute`, whose agreement
step turns a one-rank failure into an error on every rank, so a test failing
on one rank cannot shift the pairing of the collectives of the tests after
it. Tests must therefore take every rank-dependent decision from the
fixtures below, never skip on one rank only, and build full tensors from the
per-test seed (the same on every rank).
"""

from __future__ import annotations

import os
import pathlib
import zlib
from typing import NamedTuple

# The communicator reads its timeout once, at the first multi-device
# execute: a small one turns a desynchronized test into an error, not a hang.
os.environ.setdefault("HOSTIR_TIMEOUT", "30")

import pytest  # noqa: E402
import torch  # noqa: E402

import hostir  # noqa: E402

_HERE = pathlib.Path(__file__).resolve().parent
_SKIP_REASON = (
    "multi-device test: needs at least 2 ranks (run under mpirun or torchrun, "
    "as tests/python/test_multidevice_mpirun.py does)"
)


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected item of the session, not only this
    # directory's: mark ours alone.
    if hostir.world_size() >= 2:
        _deselect_mailbox_tests_across_nodes(config, items)
        _deselect_what_this_job_cannot_run(config, items)
        return
    skip = pytest.mark.skip(reason=_SKIP_REASON)
    for item in items:
        if _HERE in pathlib.Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


def _deselect_mailbox_tests_across_nodes(config, items) -> None:
    """A job the launcher splits into nodes has no mailbox: of
    test_mailbox.py only the test that says so runs (the same on every
    rank: every rank's launcher gives the same split)."""
    launch = hostir.communicator.discover()
    if launch.local_size is None or launch.local_size == launch.world_size:
        return
    mailbox_tests = _HERE / "test_mailbox.py"
    dropped = [
        item for item in items
        if pathlib.Path(str(item.path)).resolve() == mailbox_tests
        and item.name != "test_the_mailbox_follows_the_launchers_nodes"
    ]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


def _deselect_what_this_job_cannot_run(config, items) -> None:
    """Tests marked `cuda` where there is no GPU, and tests marked
    `ranks(at_least=N, even=...)` at other world sizes, are deselected, the
    same on every rank: the suite under mpirun counts a skip as a failure,
    so what a job cannot run is left out, never skipped (the GPU suite,
    tools/gpu_check.py, runs the `cuda` ones; the 4-rank job the others)."""
    size = hostir.world_size()

    def runnable(item) -> bool:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            return False
        ranks = item.get_closest_marker("ranks")
        if ranks is not None:
            if size < ranks.kwargs.get("at_least", 2) or (ranks.kwargs.get("even", False) and size % 2):
                return False
        return True

    dropped = [item for item in items if _HERE in pathlib.Path(str(item.path)).resolve().parents and not runnable(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


class World(NamedTuple):
    size: int
    rank: int
    local_rank: int


@pytest.fixture(scope="session")
def world() -> World:
    """This process's place in the job (no process group needed)."""
    return World(hostir.world_size(), hostir.rank(), hostir.local_rank())


@pytest.fixture
def device(world) -> torch.device:
    """Where a rank's inputs live: its GPU under NCCL, else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed(request):
    """The same seed on every rank, from the test's id (not its position in
    the run), so every rank builds the same full tensors."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_runtest_logreport(report):
    """Print a failure's traceback when it happens, not in the summary at the
    end: a rank that aborts later (a peer's NCCL watchdog, a signal) never
    prints that summary, and the first failure is the one that explains the
    rest."""
    if not report.failed or hostir.world_size() < 2:
        return
    text = report.longreprtext.splitlines()
    tail = text[-60:]
    lines = [f"\n---- rank {hostir.rank()}: {report.nodeid} failed ({report.when}) ----"]
    lines += (["..."] if len(text) > len(tail) else []) + tail
    print("\n".join(lines), flush=True)
