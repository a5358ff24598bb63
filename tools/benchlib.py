"""What the scripts that drive a GPU machine share (`gpu_check.py`,
`gpu_bench.py`): steps run as subprocesses in sessions of their own under a
time limit and a total budget, each with its own log, the whole process
group ended after each step; a free port per job; the machine's tag
(`h100x2`, `h200x2`, ...) that names result files; the environment a job
runs hostir from this tree in.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
_SUMMARY_LINE = re.compile(
    r"^(?:=+ )?(?P<body>\d+ (?:passed|failed|errors?|skipped|deselected|xfailed)[^\n]*?) in [\d.]+s", re.M
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    """Runs steps under limits, records their outcome, keeps the budget."""

    def __init__(self, logs: pathlib.Path, budget: float) -> None:
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.budget = budget
        self.steps: list[dict] = []

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def skip(self, name: str, why: str) -> None:
        self.steps.append({"step": name, "status": f"skipped: {why}", "seconds": 0.0, "detail": ""})
        print(f"--- {name}: skipped, {why}", flush=True)

    def step(
        self,
        name: str,
        limit: float,
        command: list[str],
        env: dict[str, str] | None = None,
        check=None,
        ranks: int = 0,
        minimum: float = 10,
    ) -> bool:
        """Run `command` with at most `limit` seconds (less if the budget is
        short; skipped below `minimum`); its output goes to logs/NAME.log.
        `check(log_text)` may return an error string that fails a command
        that exited 0."""
        log = self.logs / f"{name}.log"
        limit = min(limit, self.left() - 5)
        record = {"step": name, "command": " ".join(command), "log": log.name}
        if limit < minimum:
            record.update(status="skipped: no time left", seconds=0.0, detail="")
            self.steps.append(record)
            print(f"--- {name}: skipped, no time left", flush=True)
            return False
        print(f"=== {name} (limit {limit:.0f} s): {record['command'][:200]}", flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            f.write(f"$ {record['command']}\n")
            f.flush()
            proc = subprocess.Popen(
                command,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env or os.environ.copy(),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                kill_session(proc)
        seconds = time.monotonic() - t0
        text = log.read_text(errors="replace")
        if rc is None:
            status = f"TIMEOUT after {limit:.0f} s"
        elif rc != 0:
            status = f"FAILED (exit {rc})"
        else:
            problem = check(text) if check else None
            status = f"FAILED ({problem})" if problem else "passed"
        detail = outcome(text)
        if ranks:
            # Each rank's own outcome, from its own log.
            per_rank = [outcome(read(self.logs / f"{name}.rank{r}.log")) or "no output" for r in range(ranks)]
            detail = "; ".join(f"rank {r}: {d}" for r, d in enumerate(per_rank))
        record.update(status=status, seconds=round(seconds, 1), detail=detail)
        self.steps.append(record)
        print(f"--- {name}: {status} in {seconds:.1f} s {detail}", flush=True)
        if status != "passed":
            print("\n".join("    " + line for line in text.splitlines()[-25:]), flush=True)
        return status == "passed"


def kill_session(proc: subprocess.Popen) -> None:
    """End the step's process group: ranks outliving a killed launcher would
    hold the GPUs and ports of the next step."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
    # The group leader is gone; stragglers of the group may remain.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read(path: pathlib.Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def outcome(text: str) -> str:
    """A step's pytest summary, else its last line of output."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("$ ")]
    return pytest_results(text) or (lines[-1][:160] if lines else "")


def pytest_results(text: str) -> str:
    found = [m.group("body") for m in _SUMMARY_LINE.finditer(text)]
    return "; ".join(dict.fromkeys(found))


def machine_tag(gpus: list[str]) -> str:
    """`h100x2` for two H100s (the model from the device name), `cpu` for none."""
    if not gpus:
        return "cpu"
    name = gpus[0]
    model = next((m for m in ("H200", "H100", "A100", "L40S", "L4", "B200", "GB200") if m in name), None)
    model = model or re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
    return f"{model.lower()}x{len(gpus)}"


def job_env(extra: dict[str, str] | None = None, tree: pathlib.Path = REPO) -> dict[str, str]:
    """This environment with `tree`'s python/ first on PYTHONPATH, a free
    rendezvous port and a bound on every collective."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env["HOSTIR_MASTER_ADDR"] = "127.0.0.1"
    env["HOSTIR_MASTER_PORT"] = str(free_port())
    env.setdefault("HOSTIR_TIMEOUT", "60")
    env.update(extra or {})
    return env
