"""A one-node Slurm cluster for the tests: munge, slurmctld and slurmd started here.

Everything lives in one directory (keys, sockets, state, logs, slurm.conf) and the
daemons are children of the test process, in the foreground, on ports free_port()
reserves; nothing under /etc, /var or /run is used. The node declares 4 CPUs
(SlurmdParameters=config_overrides) so 4 tasks fit on a 2-core machine, and
FirstJobId is random so two clusters on one machine do not hand out the same job
ids (the launcher mapping derives MASTER_PORT from them).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from harness import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "scancel")


def missing_programs() -> list[str]:
    return [d for d in DAEMONS if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 4):
        self.root = Path(root)
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []

    # -- environment for client commands (srun, sbatch, ...) --------------------
    def env(self, extra: dict | None = None) -> dict:
        # A suite that itself runs inside a Slurm job must not attach to it.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.root / "slurm.conf")
        env.update(extra or {})
        return env

    def run(self, cmd, timeout=120, check=True, env=None, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                           env=self.env(env), **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout}{r.stderr}"
                                 f"\n--- slurmd log ---\n{self.log('slurmd')}")
        return r

    def log(self, which: str) -> str:
        path = self.root / "log" / f"{which}.log"
        return path.read_text()[-4000:] if path.exists() else ""

    # -- lifecycle ---------------------------------------------------------------
    def start(self, timeout: float = 60) -> "SlurmCluster":
        r = self.root
        for sub in ("munge", "log", "state", f"spool/{self.node}", "run"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mungekey", "--create", "--force", f"--keyfile={r / 'munge/munge.key'}"], check=True,
                       capture_output=True, timeout=60)
        socket_path = r / "munge" / "munge.socket"
        # -f: pytest's temporary folders are private (0700), which munged
        # otherwise refuses for its socket.
        self._spawn([_which("munged"), "-F", "-f", f"--socket={socket_path}", f"--key-file={r / 'munge/munge.key'}",
                     f"--pid-file={r / 'munge/munged.pid'}", f"--log-file={r / 'log/munged.log'}",
                     f"--seed-file={r / 'munge/munged.seed'}"])
        self._wait(lambda: socket_path.exists(), timeout, "munged did not create its socket")
        ctld_port, slurmd_port = free_port(), free_port()
        (r / "plugstack.conf").write_text("")
        (r / "slurm.conf").write_text(f"""\
ClusterName=oneccltest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'run/slurmctld.pid'}
SlurmdPidFile={r / 'run'}/slurmd-%n.pid
SlurmctldLogFile={r / 'log/slurmctld.log'}
SlurmdLogFile={r / 'log/slurmd.log'}
PlugStackConfig={r / 'plugstack.conf'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
InactiveLimit=0
KillWait=5
MinJobAge=300
FirstJobId={random.randint(1000, 60_000_000)}
NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={self.node} CPUs={self.cpus} Port={slurmd_port} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        conf = str(r / "slurm.conf")
        self._spawn([_which("slurmctld"), "-D", "-c", "-f", conf])
        self._spawn([_which("slurmd"), "-D", "-f", conf, "-N", self.node])

        def idle():
            out = self.run(["sinfo", "-h", "-n", self.node, "-o", "%t"], check=False, timeout=10).stdout.strip()
            return out in ("idle", "mix", "alloc")

        self._wait(idle, timeout, "the node never became idle")
        return self

    def stop(self):
        self.run(["scancel", "--full", "--user", str(os.getuid())], check=False, timeout=30)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # Step daemons detach from slurmd; theirs is the only cwd under our folder.
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd").startswith(str(self.root)):
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    # -- helpers -------------------------------------------------------------------
    def _spawn(self, cmd):
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.stdout", "w")
        self.procs.append(subprocess.Popen([str(c) for c in cmd], cwd=self.root / "log", stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True, env=self.env()))

    def _wait(self, ok, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{what}: {dead} exited\n{self.log('slurmctld')}\n{self.log('slurmd')}")
            time.sleep(0.1)
        raise RuntimeError(f"{what} within {timeout} s\n{self.log('slurmctld')}\n{self.log('slurmd')}")

    def sbatch_wait(self, script: Path, cwd: Path, timeout: float = 180, env=None) -> tuple[str, str, str]:
        """Submits a batch script to run in `cwd`; returns (job id, final state, its output)."""
        out = self.root / "batch-%j.out"
        jid = self.run(["sbatch", "--parsable", f"--output={out}", f"--chdir={cwd}", script],
                       env=env).stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            info = self.run(["scontrol", "-o", "show", "job", jid], check=False, timeout=10).stdout
            fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                break
            time.sleep(0.2)
        else:
            self.run(["scancel", jid], check=False)
            raise AssertionError(f"batch job {jid} still {state} after {timeout} s")
        text = Path(str(out).replace("%j", jid))
        return jid, state, text.read_text() if text.exists() else ""
