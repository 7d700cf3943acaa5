"""Runs distributed_spawn.py for one backend and world size, and reads back each case's outcome.

The suite runs in its own pytest process (its configuration lives in
environment variables read at import time, as in PyTorch's CI), in its own
session so that whatever is left of it, ranks included, is killed at the end.
Outcomes come from the JUnit XML it writes.

Time limits, innermost first:
- the process group timeout, 60 s unless the case sets its own (PyTorch's
  ``default_pg_timeout`` / ``CUSTOM_PG_TIMEOUT``);
- the case timeout: PyTorch's own (``common_distributed.TIMEOUT_DEFAULT``,
  from DISTRIBUTED_TESTS_DEFAULT_TIMEOUT, with ``TIMEOUT_OVERRIDE`` for the
  few long cases, to which distributed_spawn.py adds PYTORCH_SUITE_CASE_TIMEOUTS:
  short ones for the known hangs): the parent then logs each live rank's
  stack, kills the ranks and fails the case with "terminated or timed out";
- pytest-timeout, a backstop above both, in case the parent itself hangs;
- the whole run's timeout, after which the run's process group is killed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from pytorch_suite.known_issues import hang_timeouts

HERE = Path(__file__).resolve().parent
SUITE = HERE / "distributed_spawn.py"
# The longest TIMEOUT_OVERRIDE entry in common_distributed (test_DistributedDataParallel).
LONGEST_OVERRIDE = 500
DEFAULT_CASE_TIMEOUT = 240
# Variables that change how torch's test utilities behave (IS_CI, IS_SANDCASTLE, ...);
# the suite runs the same on a laptop and in CI.
SCRUBBED_ENV = ("CI", "SANDCASTLE", "TW_JOB_USER", "PYTORCH_TEST_FBCODE", "TORCH_DISTRIBUTED_DEBUG",
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclasses.dataclass
class CaseResult:
    name: str
    outcome: str  # PASSED, FAILED or SKIPPED (errors count as failures)
    seconds: float
    message: str = ""  # the skip reason, or the failure's message
    details: str = ""  # the failure's full text (rank tracebacks)

    @property
    def timed_out(self) -> bool:
        text = self.message + self.details
        return self.outcome == FAILED and ("terminated or timed out" in text or "Timeout" in self.message)


@dataclasses.dataclass
class SuiteRun:
    backend: str
    world_size: int
    cases: dict[str, CaseResult]
    wall_seconds: float
    returncode: int  # pytest's; 0 or 1 when every selected case ran
    output: str  # pytest's console output
    # Where a ccl run's data went (selection.TRANSPORT_ENV): "shm" (the package's shared
    # memory, its default on one host) or "oneccl"; runs saved before it was recorded were shm.
    transport: str = "shm"

    @property
    def complete(self) -> bool:
        return self.returncode in (0, 1)

    def save(self, path: Path) -> None:
        data = dataclasses.asdict(self)
        data["cases"] = [dataclasses.asdict(c) for c in self.cases.values()]
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: Path) -> "SuiteRun":
        data = json.loads(Path(path).read_text())
        data["cases"] = {c["name"]: CaseResult(**c) for c in data["cases"]}
        return cls(**data)

    def counts(self) -> dict[str, int]:
        out = {PASSED: 0, FAILED: 0, SKIPPED: 0}
        for case in self.cases.values():
            out[case.outcome] += 1
        return out


def suite_env(backend: str, world_size: int, temp_dir: Path, case_timeout: int, init_method: str,
              case_timeouts: dict[str, int] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    (temp_dir / "barrier").mkdir(parents=True, exist_ok=True)
    env.update(
        BACKEND=backend,
        WORLD_SIZE=str(world_size),
        TEMP_DIR=str(temp_dir),
        # PyTorch's CI runs the suite with both; file:// also enables test_barrier_timeout_global.
        INIT_METHOD=f"file://{temp_dir}/init_file" if init_method == "file" else "env://",
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(case_timeout),
        PYTORCH_SUITE_CODE_CACHE=str(temp_dir / "distributed_test.code"),
        PYTORCH_SUITE_CASE_TIMEOUTS=json.dumps(case_timeouts or {}),
    )
    return env


def run_suite(
    backend: str,
    world_size: int,
    *,
    select: list[str] | None = None,
    case_timeout: int = DEFAULT_CASE_TIMEOUT,
    init_method: str = "file",
    case_timeouts: dict[str, int] | None = None,
    timeout: float | None = None,
    junit_xml: Path | None = None,
    log: Path | None = None,
    start: str = "spawn",
    env: dict[str, str] | None = None,
) -> SuiteRun:
    """Runs the suite's cases (all, or the names in `select`) on `backend`.

    case_timeouts: seconds for particular cases (default: short ones for the known hangs).
    start: how a case starts its ranks, "spawn" (as torch's CI) or "fork" (selection.Plan.start).
    env: variables for the ranks beside the suite's (selection.TRANSPORT_ENV's).
    """
    if start not in ("spawn", "fork"):
        raise ValueError(f"start must be 'spawn' or 'fork', not {start!r}")
    if select is not None and not select:
        raise ValueError("select names no case (None runs them all)")
    if case_timeouts is None:
        case_timeouts = hang_timeouts()
    with tempfile.TemporaryDirectory(prefix=f"pytorch-suite-{backend}-{world_size}-") as tmp:
        tmp = Path(tmp)
        junit = junit_xml or tmp / "junit.xml"
        node = f"{SUITE}::TestDistBackendWithSpawn{backend.upper()}"
        # pytest puts tests/ (the rootdir) on sys.path for pytorch_suite. Its console script, not
        # `python -m pytest`, keeps the cwd off sys.path (python -P would too, but only from 3.11).
        cmd = [
            str(Path(sys.executable).with_name("pytest")),
            *([f"{node}::{name}" for name in select] if select is not None else [str(SUITE)]),
            "-p", "no:cacheprovider",
            "--rootdir", str(HERE.parent),
            "-o", "addopts=",
            "-q", "-rfE",
            f"--timeout={max(case_timeout, LONGEST_OVERRIDE) + 120}",
            f"--junitxml={junit}",
            "-o", "junit_family=xunit1",
            # The parent's log: on a timeout, PyTorch logs each live rank's stack there.
            "-o", "junit_logging=log",
        ]
        ranks_env = {**suite_env(backend, world_size, tmp / "run", case_timeout, init_method, case_timeouts),
                     **(env or {}), "PYTORCH_SUITE_START": start}
        start = time.monotonic()
        out_file = open(log, "w+") if log else tempfile.TemporaryFile("w+")
        with out_file:
            proc = subprocess.Popen(cmd, cwd=HERE.parent, env=ranks_env, stdout=out_file, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                _kill_session(proc.pid)
                if returncode is None:
                    returncode = proc.wait()
            wall = time.monotonic() - start
            out_file.seek(0)
            output = out_file.read()
        cases = read_junit(junit) if junit.exists() else {}
        if not cases:
            tail = "\n".join(output.splitlines()[-40:])
            raise RuntimeError(f"the {backend} suite (world size {world_size}) reported no case (exit {returncode}):\n{tail}")
        return SuiteRun(backend, world_size, cases, wall, returncode, output)


def inventory(backend: str, world_size: int) -> dict:
    """inventory.py's answer for this configuration: each case's skip reason, or None if it spawns ranks."""
    with tempfile.TemporaryDirectory(prefix="pytorch-suite-inventory-") as tmp:
        env = suite_env(backend, world_size, Path(tmp), DEFAULT_CASE_TIMEOUT, "file")
        # Run from tests/ (not the source tree's root, whose oneccl_bind_pt is not built).
        proc = subprocess.run([sys.executable, "-m", "pytorch_suite.inventory"], cwd=HERE.parent, env=env,
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"pytorch_suite.inventory failed for {backend}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kill_session(pid: int) -> None:
    """Kills the suite's process group: pytest and any rank still alive."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_junit(path: Path) -> dict[str, CaseResult]:
    cases = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = tc.get("name")
        seconds = float(tc.get("time") or 0)
        problem = tc.find("failure")
        if problem is None:
            problem = tc.find("error")
        skipped = tc.find("skipped")
        if problem is not None:
            log = "\n".join(node.text or "" for node in tc.iter() if node.tag in ("system-out", "system-err"))
            cases[name] = CaseResult(name, FAILED, seconds, problem.get("message") or "", (problem.text or "") + log)
        elif skipped is not None:
            cases[name] = CaseResult(name, SKIPPED, seconds, _skip_reason(skipped))
        else:
            cases[name] = CaseResult(name, PASSED, seconds)
    return cases


def _skip_reason(node) -> str:
    # xunit1 writes "file:line: reason" in the text; the message attribute is the bare reason.
    return (node.get("message") or node.text or "").strip()
