"""The installed package: import names, attributes, the torch pin, launcher mapping."""

import datetime
import importlib.metadata
import json
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from harness import communicate, import_or_require, popen
from packaging.requirements import Requirement
import torch.distributed as dist

import oneccl_bind_pt
from oneccl_bind_pt import _env
from oneccl_bind_pt._build_info import TORCH_BUILT_WITH

# The release this build is: the row of the release table for the installed torch.
ROW = oneccl_bind_pt.release_for(torch.__version__)
OTHER_ROWS = [r for r in oneccl_bind_pt.supported_releases() if r["torch"] != ROW["torch"]]


def test_three_import_names_are_one_module():
    import oneccl_bindings_for_pytorch
    import torch_ccl

    assert oneccl_bindings_for_pytorch is oneccl_bind_pt is torch_ccl
    for name in ("oneccl_bind_pt", "oneccl_bindings_for_pytorch", "torch_ccl"):
        assert importlib.util.find_spec(name) is not None


def test_cwd_version_and_registration():
    import torch_ccl

    assert oneccl_bind_pt.__version__ == ROW["version"]
    assert importlib.metadata.version("oneccl_bind_pt") == oneccl_bind_pt.__version__
    assert oneccl_bind_pt.cwd == os.path.dirname(torch_ccl.__file__)
    assert os.path.isfile(os.path.join(oneccl_bind_pt.cwd, "env", "setvars.sh"))
    assert "ccl" in dist.Backend.backend_list
    assert dist.ProcessGroupCCL is oneccl_bind_pt.ProcessGroupCCL
    assert issubclass(dist.ProcessGroupCCL, torch._C._distributed_c10d.Backend)


def test_extension_is_self_contained():
    so = oneccl_bind_pt._C.__file__
    undefined = subprocess.run(["nm", "-D", "--undefined-only", so], capture_output=True, text=True, check=True,
                               timeout=60).stdout
    assert "_ZN3ccl" not in undefined
    needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True, check=True, timeout=60).stdout
    assert "libccl" not in needed and "libsycl" not in needed  # oneCCL is linked in, CPU only
    assert "$ORIGIN/../../.." in needed


def _import_with_torch(version, cwd):
    code = f"import torch; torch.__version__ = {version!r}; import oneccl_bind_pt"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_other_torch_version_is_refused_with_a_clear_message(tmp_path):
    proc = _import_with_torch("2.8.0+cpu", tmp_path)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    built = TORCH_BUILT_WITH.split("+")[0]
    for needle in ("2.8.0+cpu", TORCH_BUILT_WITH, f"pip install torch=={built}",
                   "No oneccl_bind_pt release supports torch 2.8.0+cpu"):
        assert needle in proc.stderr, proc.stderr


# One interpreter tries every other release's torch (a failed import leaves nothing behind in
# sys.modules, so each try runs the check afresh): importing a CUDA torch takes 10-15 s.
_EACH_OTHER_TORCH = """
import json, sys, torch
said = {}
for seen in sys.argv[1:]:
    torch.__version__ = seen
    try:
        import oneccl_bind_pt
        said[seen] = "imported"
    except ImportError as e:
        said[seen] = str(e)
print(json.dumps(said))
"""


def test_torch_of_another_release_names_the_oneccl_bind_pt_that_matches_it(tmp_path):
    seen = {f"{other['torch'].rsplit('.', 1)[0]}.9+cu130": other for other in OTHER_ROWS}  # any patch and build
    proc = subprocess.run([sys.executable, "-c", _EACH_OTHER_TORCH, *seen], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(said) == sorted(seen)
    for version, other in seen.items():
        public = other["version"].split("+")[0]
        for needle in (f"torch {version} install oneccl_bind_pt {other['version']}",
                       f"pip install oneccl_bind_pt=={public}", f"pip install torch=={TORCH_BUILT_WITH.split('+')[0]}"):
            assert needle in said[version], (version, said[version])


def test_supported_releases_are_the_table(tmp_path):
    # Against meta/releases.yaml read here, not against the package's own table (the installed
    # package may be an older build than the checkout's table), then against what the import
    # check really does with each release's torch.
    meta = yaml.safe_load((Path(__file__).resolve().parent.parent / "meta" / "releases.yaml").read_text())
    want = {(r["torch"], tuple(r["python"]), r["oneccl"], r["impi_rt"], r["tcmlib"]) for r in meta["releases"]}
    rows = oneccl_bind_pt.supported_releases()
    assert {(r["torch"], tuple(r["python"]), r["oneccl"], r["impi_rt"], r["tcmlib"]) for r in rows} == want
    for r in rows:  # plain torch versions, and the torch minor as the requirement
        major, minor = map(int, r["torch"].split(".")[:2])
        assert r["version"] == r["torch"] and r["torch_requirement"] == f"torch>={r['torch']},<{major}.{minor + 1}", r
    # Another patch of each release's torch: only the installed torch's minor imports (tried
    # last: a module imported once is not checked again); every other names its release.
    mine = [r for r in meta["releases"] if r["torch"].split(".")[:2] == torch.__version__.split(".")[:2]]
    assert len(mine) == 1, torch.__version__
    order = [r for r in meta["releases"] if r is not mine[0]] + mine
    seen = {f"{r['torch'].rsplit('.', 1)[0]}.7+cpu": r["torch"] for r in order}
    proc = subprocess.run([sys.executable, "-c", _EACH_OTHER_TORCH, *seen], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)  # one interpreter, no ranks: nothing outlives a timeout
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout.splitlines()[-1])
    for version, release in seen.items():
        if release == mine[0]["torch"]:
            assert said[version] == "imported", (version, said[version])
        else:
            assert f"install oneccl_bind_pt {release}" in said[version], (version, said[version])


def test_metadata_declares_the_torch_minor_and_the_runtime():
    """What makes `pip install <wheel>` work without a compiler: runtime deps, not oneccl-devel."""
    def parsed(reqs):
        return {r.name: r.specifier for r in map(Requirement, reqs)}

    assert parsed(importlib.metadata.requires("oneccl_bind_pt")) == parsed(
        [ROW["torch_requirement"], f"impi-rt=={ROW['impi_rt']}", f"tcmlib=={ROW['tcmlib']}"])


def test_defaults_never_override_the_user():
    store = dist.HashStore()
    store.set("oneccl/defaults/shm/1", "1")  # rank 1 has shared memory on (the ranks of one host tell each other)
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "CCL_ATL_SHM": "0", "CCL_WORKER_COUNT": "2",
           "TORCH_INCLUDE_STACK_TRACE": "1", "FI_SHM_DISABLE_CMA": "0"}
    _env.apply_ccl_defaults(store, 0, 2, env)
    assert not store.check(["oneccl/defaults/host/0"])  # the launcher said where the ranks are
    assert env["CCL_ATL_SHM"] == "0"
    assert env["TORCH_INCLUDE_STACK_TRACE"] == "1"
    assert env["FI_SHM_DISABLE_CMA"] == "0"
    assert "CCL_WORKER_OFFLOAD" not in env  # the user manages workers
    assert env["CCL_LOCAL_RANK"] == "0" and env["CCL_LOCAL_SIZE"] == "2"
    assert env["CCL_KVS_IFACE"] == "lo"


def test_defaults_a_parent_set_are_set_afresh_in_its_children():
    # A process that made a ccl group across hosts, then starts a job on one host (a notebook
    # running mp.spawn): its children inherit its environment, with the package's values in it.
    parent = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}
    _env.apply_ccl_defaults(dist.HashStore(), 0, 2, parent)
    assert (parent["CCL_LOCAL_SIZE"], parent["CCL_ATL_SHM"]) == ("1", "1"), parent
    child = {k: v for k, v in parent.items() if not k.startswith(("LOCAL_", "WORLD_"))}
    child.update({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "CCL_LOG_LEVEL": "info"})
    store = dist.HashStore()
    store.set("oneccl/defaults/shm/0", "1")
    _env.apply_ccl_defaults(store, 1, 2, child)
    # This group's values, not the parent's; the one the user changed since stays the user's.
    assert (child["CCL_LOCAL_RANK"], child["CCL_LOCAL_SIZE"], child["CCL_ATL_SHM"], child["CCL_KVS_IFACE"]) == (
        "1", "2", "0", "lo"), child
    assert child["CCL_LOG_LEVEL"] == "info"
    assert json.loads(child[_env.MARK]).get("CCL_LOG_LEVEL") is None, child[_env.MARK]
    assert not _env.set_by_user(child, "CCL_WORKER_OFFLOAD") and _env.set_by_user(child, "CCL_LOG_LEVEL")


def test_shared_memory_off_on_another_rank_gives_oneccl_its_own_here():
    # Rank 1 has ONECCL_BIND_PT_SHM=0: oneCCL carries the group on every rank, with its shared
    # memory (CCL_ATL_SHM must be alike on all ranks), and may get workers.
    store = dist.HashStore()
    store.set("oneccl/defaults/shm/1", "0")
    store.set("oneccl/defaults/workers/1", "2")  # and would take as many workers as this one, or more
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "ONECCL_BIND_PT_WORKERS": "auto"}
    _env.apply_ccl_defaults(store, 0, 2, env)
    assert env["CCL_ATL_SHM"] == "1", env
    assert _env.workers_why.startswith("auto: ") and "shared memory carries" not in _env.workers_why, _env.workers_why


def test_without_a_launcher_one_round_says_hosts_and_shared_memory():
    # mp.spawn or a hand-written script: no LOCAL_RANK. The host names and the shared-memory
    # switch travel in one round; no second ("shm") round is waited for.
    host = _env.host_identity()
    assert host.endswith("|" + socket.gethostname()) and host.count("|") == 3, host
    # Another host of the same name (a cloned VM, a container's fixed --hostname) is another host.
    twin = "another-boot" + host[host.index("|"):]
    for theirs, local_size, atl_shm in ((f"0 {host}", "2", "1"), (f"1 {host}", "2", "0"), ("1 elsewhere", "1", "1"),
                                        (f"1 {twin}", "1", "1")):
        store = dist.HashStore()
        store.set("oneccl/defaults/host/1", theirs)
        env = {"WORLD_SIZE": "2"}
        _env.apply_ccl_defaults(store, 0, 2, env, timeout=datetime.timedelta(seconds=5))
        assert store.get("oneccl/defaults/host/0").decode() == f"1 {host}"
        assert not store.check(["oneccl/defaults/shm/0"]), theirs
        assert (env["CCL_LOCAL_RANK"], env["CCL_LOCAL_SIZE"], env["CCL_ATL_SHM"]) == ("0", local_size, atl_shm), theirs


def test_first_group_exchange_is_bounded_and_hears_of_failures():
    # Rank 0 of 2 on one host, rank 1 never comes: the group's timeout, rank 1 named, and the
    # short reason the other ranks are told.
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"^ccl rendezvous: rank 0 waited 1\.0 s for the other ranks of "
                       r"this process group \(size 2\); missing ranks: 1\.") as caught:
        _env.apply_ccl_defaults(dist.HashStore(), 0, 2, dict(env), timeout=datetime.timedelta(seconds=1))
    assert 0.9 <= time.monotonic() - start < 10  # a store's wait may wake a few microseconds early
    assert caught.value.announce == "it waited 1.0 s for the other ranks; missing ranks: 1"
    # A rank announced that it cannot create the group: given up on within a slice, not the timeout.
    store = dist.HashStore()
    store.set("oneccl/failed", "rank 1 could not create its side of this process group: because")
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"^ccl rendezvous: rank 1 could not create its side of this "
                       r"process group: because \(rank 0 gives up on this process group with it\)$"):
        _env.apply_ccl_defaults(store, 0, 2, dict(env), timeout=datetime.timedelta(seconds=60))
    assert time.monotonic() - start < 10


# oneCCL's worker threads (_env.worker_plan): (ONECCL_BIND_PT_WORKERS, oneCCL carries the
# collectives, local rank, local size, cores for the rank, pinned, torch threads, CPUs, SMT
# siblings: CPU c is on core c % this, or None) -> (count, worker CPUs).
WORKER_CASES = {
    "unset-none-whatever-the-cores": ("", True, 1, 2, 8, False, 1, range(16), None, 0, []),
    "auto-one-host-shm-carries": ("auto", False, 0, 2, 8, False, 1, range(16), None, 0, []),
    "auto-across-hosts-8-cores-1-thread": ("auto", True, 1, 2, 8, False, 1, range(16), None, 2, [14, 15]),
    "auto-compute-uses-all": ("auto", True, 0, 2, 8, False, 8, range(16), None, 0, []),
    "auto-2-spare": ("auto", True, 0, 4, 3, False, 1, range(12), None, 1, [2]),
    "auto-1-spare": ("auto", True, 0, 1, 2, False, 1, range(2), None, 0, []),
    "auto-pinned-to-its-own-cpus": ("auto", True, 3, 4, 4, True, 1, [4, 5, 6, 7], None, 2, [6, 7]),
    # a job-wide taskset: both ranks see the same 16 CPUs as their own
    "auto-one-set-shared-rank-0": ("auto", True, 0, 2, 16, True, 1, range(16), None, 2, [14, 15]),
    "auto-one-set-shared-rank-1": ("auto", True, 1, 2, 16, True, 1, range(16), None, 2, [12, 13]),
    # 16 cores x 2 threads, siblings c and c + 16: rank 1's block is cores 8-15, not CPUs 16-31
    "auto-smt-siblings-rank-1": ("auto", True, 1, 2, 16, False, 1, range(32), 16, 2, [14, 15]),
    "auto-smt-siblings-rank-0": ("auto", True, 0, 2, 16, False, 1, range(32), 16, 2, [6, 7]),
    "forced-on-one-host": ("1", False, 1, 2, 1, False, 1, range(2), None, 1, [1]),
    "forced-beyond-the-block": ("3", True, 0, 2, 1, False, 1, range(2), None, 3, [0, 0, 0]),
    "forced-off": ("0", True, 0, 1, 16, False, 1, range(16), None, 0, []),
}


@pytest.mark.parametrize("case", list(WORKER_CASES))
def test_oneccl_workers_follow_the_spare_cores(case):
    asked, carries, local_rank, local_size, cores, pinned, threads, cpus, smt, count, where = WORKER_CASES[case]
    got = _env.worker_plan({"ONECCL_BIND_PT_WORKERS": asked}, local_rank=local_rank, local_size=local_size,
                           oneccl_carries=carries, cores=cores, pinned=pinned, torch_threads=threads, cpus=list(cpus),
                           core_of=lambda c: (0, c % smt if smt else c))
    assert got[:2] == (count, where), got


def test_oneccl_workers_variables_and_refusal():
    # Across hosts (1 rank here of 2), a worker forced: the three variables, this rank's slice.
    store = dist.HashStore()
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2", "ONECCL_BIND_PT_WORKERS": "1"}
    _env.apply_ccl_defaults(store, 0, 2, env)
    cpus = sorted(os.sched_getaffinity(0), key=lambda c: (*_env.core_of(c), c))
    last = str(min(c for c in cpus if _env.core_of(c) == _env.core_of(cpus[-1])))  # the last core's first CPU
    assert (env["CCL_WORKER_OFFLOAD"], env["CCL_WORKER_COUNT"], env["CCL_WORKER_AFFINITY"]) == ("1", "1", last), env
    assert env["CCL_ATL_SHM"] == "1"
    # Not asked for: none, across hosts too, and the doctor's reason.
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}
    _env.apply_ccl_defaults(store, 0, 2, env)
    assert env["CCL_WORKER_OFFLOAD"] == "0" and "CCL_WORKER_COUNT" not in env, env
    assert _env.workers_why == _env.OFF_BY_DEFAULT
    # auto with every rank on this host: our shared memory carries the collectives, oneCCL gets none.
    store = dist.HashStore()
    store.set("oneccl/defaults/shm/1", "1")  # rank 1 has shared memory on
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "ONECCL_BIND_PT_WORKERS": "auto"}
    _env.apply_ccl_defaults(store, 0, 2, env)
    assert env["CCL_WORKER_OFFLOAD"] == "0" and "CCL_WORKER_COUNT" not in env, env
    assert env["CCL_ATL_SHM"] == "0"
    for mine in ({}, {"CCL_WORKER_COUNT": "1"}):  # refused also where the user manages the workers
        with pytest.raises(ValueError, match="ONECCL_BIND_PT_WORKERS=some is not auto or a whole number from 0 to 64"):
            _env.apply_ccl_defaults(store, 0, 2, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2",
                                                  "ONECCL_BIND_PT_WORKERS": "some", **mine})


def test_auto_workers_are_the_fewest_any_rank_would_take(monkeypatch):
    # oneCCL splits each collective into one part per worker on every rank: with `auto`, a rank
    # with 8 cores (2 workers) and one with fewer (1) both take 1. (rank_cores is this package's
    # own reading of the host, given here; oneCCL is not involved.)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    from oneccl_bind_pt import _C

    monkeypatch.setattr(_C, "rank_cores", lambda local_size: (8, False, "8 for the test", None))
    for theirs, count in (("1", "1"), ("2", "2"), ("0", None)):
        store = dist.HashStore()
        store.set("oneccl/defaults/workers/1", theirs)
        store.set("oneccl/defaults/route/1", "192.0.2.2")  # the other host's address towards rank 0's
        env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2", "ONECCL_BIND_PT_WORKERS": "auto"}
        _env.apply_ccl_defaults(store, 0, 2, env, timeout=datetime.timedelta(seconds=5))
        assert store.get("oneccl/defaults/workers/0").decode() == "2"  # what this rank would take
        assert env.get("CCL_WORKER_COUNT") == count, (theirs, env)
        if count:
            assert len(env["CCL_WORKER_AFFINITY"].split(",")) == int(count), env
        if theirs != "2":
            assert "the fewest of any rank" in _env.workers_why, _env.workers_why


def test_a_first_group_within_one_host_of_a_job_across_hosts_leaves_oneccl_ready_for_both():
    # gloo's default group, then a ccl group of this host's 2 ranks (of 4 on two hosts), first:
    # oneCCL reads its variables once, so a later ccl group across hosts needs them too.
    host = _env.host_identity()
    store = dist.HashStore()
    store.set("oneccl/defaults/host/1", f"1 {host}")
    towards = "192.0.2.1"  # documentation's address: routed as another host's would be, never reached
    store.set("oneccl/defaults/route/1", "")  # the other rank of this host: no route either
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "MASTER_ADDR": towards}
    _env.apply_ccl_defaults(store, 0, 2, env, timeout=datetime.timedelta(seconds=5))
    assert (env["CCL_LOCAL_RANK"], env["CCL_LOCAL_SIZE"]) == ("0", "2"), env
    # Not loopback (the old choice for a group within one host, which a group across hosts cannot
    # reach): the interface towards the job's rank 0, where there is a route to it.
    assert env.get("CCL_KVS_IFACE") == _env.interface_towards(towards) and env.get("CCL_KVS_IFACE") != "lo", env
    # oneCCL's own shared memory is set up at its first communicator from that one's ranks, and a
    # later communicator across hosts then hung in its creation (test_two_hosts.py): off here.
    assert env["CCL_ATL_SHM"] == "0", env


def test_on_rank_0s_host_a_master_name_that_is_loopback_there_takes_the_interface_towards_the_others():
    # Debian's /etc/hosts: rank 0's own host name is 127.0.1.1 there; the route towards it is lo,
    # which the other host cannot reach. The other rank says where it reaches rank 0's host from.
    store = dist.HashStore()
    other = "192.0.2.7"  # documentation's address: routed as another host's would be, never reached
    store.set("oneccl/defaults/route/1", other)
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.1.1"}
    _env.apply_ccl_defaults(store, 0, 2, env, timeout=datetime.timedelta(seconds=5))
    assert store.get("oneccl/defaults/route/0").decode().startswith("127."), "this rank's route to itself is loopback"
    expected = _env.interface_towards(other) or next(
        name for _, name in socket.if_nameindex() if name != "lo" and _env._ipv4_of(name))
    assert env.get("CCL_KVS_IFACE") == expected != "lo" and env.get("FI_TCP_IFACE") == expected, env


@pytest.mark.parametrize("name", ["oneccl_bind_pt", "oneccl_bindings_for_pytorch", "torch_ccl"])
def test_import_in_a_fresh_interpreter(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name} as m; print(m.__version__, m.cwd)"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,  # not the checkout: the installed package
        env={k: v for k, v in os.environ.items() if not k.startswith(("CCL_", "LD_"))},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{oneccl_bind_pt.__version__} ")


SETVARS = os.path.join(oneccl_bind_pt.cwd, "env", "setvars.sh")
PREFIX = sys.prefix


@pytest.mark.parametrize("shell", ["bash", "dash"])
def test_setvars_sourced_twice_sets_the_environment_once(shell, tmp_path):
    script = (f'. "{SETVARS}"; . "{SETVARS}"; echo "$PATH"; echo "$I_MPI_ROOT"; command -v mpirun; '
              'echo "$LD_LIBRARY_PATH"; echo "$CPLUS_INCLUDE_PATH"')
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/user/lib"}
    out = subprocess.run([shell, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                         check=True, timeout=120).stdout.split("\n")  # (dash asks python3 on PATH for the prefix)
    path = out[0].split(":")
    assert path.count(os.path.join(PREFIX, "bin")) == 1, path
    assert os.path.realpath(out[1]) == os.path.realpath(PREFIX)
    assert out[2].endswith("/mpirun")
    # oneccl-devel is installed here (the build needs it): DeepSpeed's op gets what it builds with.
    assert os.path.exists(os.path.join(PREFIX, "lib", "libccl.so.1"))
    assert out[3].split(":") == [os.path.join(PREFIX, "lib"), "/opt/user/lib"], out[3]
    assert out[4].split(":") == [os.path.join(PREFIX, "include")], out[4]


def test_setvars_refuses_to_run_and_documents_itself(tmp_path):
    for shell in ("bash", "dash"):
        proc = subprocess.run([shell, SETVARS], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and "must be sourced" in proc.stderr, (shell, proc.stderr)
    # dash cannot tell sourced from run but by $0: a job script of a similar name sources it.
    job = tmp_path / "my_setvars.sh"
    job.write_text(f'. "{SETVARS}"\necho "sourced $I_MPI_ROOT"\n')
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"}
    proc = subprocess.run(["dash", str(job)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("sourced /"), (proc.stdout, proc.stderr)
    helptext = subprocess.run(["bash", "-c", f'. "{SETVARS}" --help'], capture_output=True, text=True,
                              timeout=60).stdout
    for var in ("PATH", "I_MPI_ROOT", "CCL_ROOT", "FI_PROVIDER_PATH", "CPLUS_INCLUDE_PATH", "LD_LIBRARY_PATH"):
        assert var in helptext
    assert helptext.rstrip().endswith("Sourcing it twice changes nothing more."), helptext  # the header only


def test_setvars_puts_a_conda_envs_lib_last(tmp_path):
    """A conda env's lib has its own libstdc++, OpenSSL, ...: the system's programs keep theirs."""
    here = tmp_path / "lib" / "python3.x" / "site-packages" / "oneccl_bind_pt" / "env"
    here.mkdir(parents=True)
    shutil.copy(SETVARS, here)
    for made in ("conda-meta/history", "include/oneapi/ccl.hpp", "lib/libccl.so.1"):
        (tmp_path / made).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / made).write_text("")
    script = f'. "{here / "setvars.sh"}"; echo "$LD_LIBRARY_PATH"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/user/lib"}).stdout.strip()
    assert out.split(":") == ["/opt/user/lib", str(tmp_path / "lib")], out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build_ext(tmp_path, env):
    """setup.py build_ext into tmp_path: its checks run before anything compiles."""
    return subprocess.run([sys.executable, "setup.py", "build_ext", "-b", str(tmp_path / "lib"), "-t", str(tmp_path / "tmp")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def test_build_names_a_missing_oneccl_and_how_to_get_it(tmp_path):
    proc = _build_ext(tmp_path, {"CCL_ROOT": str(tmp_path)})
    assert proc.returncode != 0
    for needle in ("oneCCL not found under", str(tmp_path), "libccl.a", f"pip install oneccl-devel=={ROW['oneccl']}"):
        assert needle in proc.stderr, proc.stderr


def test_metadata_and_sdist_need_neither_torch_nor_oneccl(tmp_path):
    """An sdist per release is made on any machine: metadata comes from the release table."""
    for row in [ROW, *OTHER_ROWS]:
        env = {**os.environ, "ONECCL_BIND_PT_RELEASE": row["torch"], "CCL_ROOT": str(tmp_path),
               "PYTHONPATH": str(tmp_path)}
        out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0 and out.stdout.split()[-1] == row["version"], out.stdout + out.stderr


def _fake_torch(version, tmp_path):
    """A torch that only has metadata (setup.py reads the installed torch's version from it)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = tmp_path / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return {"PYTHONPATH": str(tmp_path)}


def test_build_refuses_a_torch_no_release_pairs_with(tmp_path):
    """setup.py names the supported pairs and the pip command before compiling anything."""
    proc = _build_ext(tmp_path, _fake_torch("2.8.0+cpu", tmp_path))
    assert proc.returncode != 0
    default = oneccl_bind_pt._version.RELEASES[oneccl_bind_pt._version.DEFAULT]
    for needle in ["torch 2.8.0+cpu is installed", f"pip install torch=={default['torch']}",
                   *(f"torch {r['torch']} on Python {', '.join(r['python'])} -> oneccl_bind_pt {r['version']}"
                     for r in OTHER_ROWS + [ROW])]:
        assert needle in proc.stderr, proc.stderr


def test_build_of_another_release_without_its_torch_names_the_pair_to_install(tmp_path):
    row = OTHER_ROWS[0]
    proc = _build_ext(tmp_path, {"ONECCL_BIND_PT_RELEASE": row["torch"]})
    assert proc.returncode != 0
    assert f"builds against torch {row['torch']}" in proc.stderr, proc.stderr
    assert f"pip install torch=={row['torch']} oneccl-devel=={row['oneccl']}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("row", [r for r in OTHER_ROWS + [ROW] if not r["torch"].endswith(".0")],
                         ids=lambda r: r["torch"])
def test_build_refuses_an_older_patch_than_its_release_and_names_that_release(row, tmp_path):
    """Its wheel would require torch>=X.Y.Z: the torch it was built with would not satisfy it."""
    major, minor, patch = row["torch"].split(".")
    proc = _build_ext(tmp_path, _fake_torch(f"{major}.{minor}.{int(patch) - 1}", tmp_path))
    assert proc.returncode != 0
    assert f"pip install torch=={row['torch']}" in proc.stderr, proc.stderr


def test_doctor_selftest_passes_and_flags_problems(tmp_path):
    bindir = os.path.dirname(sys.executable)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CCL_", "FI_", "I_MPI_"))}
    # The self-test starts ranks: its own session, so a timeout kills them too, not only the doctor.
    selftest = popen([sys.executable, "-m", "oneccl_bind_pt.doctor", "--selftest"], cwd=tmp_path,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env={**base, "PATH": f"{bindir}:/usr/bin:/bin"})
    (out,) = communicate([selftest], 300)
    assert selftest.returncode == 0, out
    assert f"(built against {TORCH_BUILT_WITH}: match)" in out
    assert "self-test        PASS" in out
    for row in [ROW, *OTHER_ROWS]:  # which oneccl_bind_pt goes with which torch
        assert f"oneccl_bind_pt=={row['version']} (Python {', '.join(row['python'])})" in out
    assert "CCL_WORKER_OFFLOAD=0" in out  # the defaults it applied are shown
    assert re.search(r"\n {17}helpers \d+ \(", out), out  # the helper threads it would use, and why
    assert re.search(r"\nstaging chunk    \d+ KiB: ", out), out  # what a staged step moves, and why
    # oneCCL's workers: none unless asked, why, and what `auto` would start across hosts
    assert re.search(r"\noneCCL workers   0 \(off unless asked: .*\); auto would give \d+( on CPUs? [\d,]+)? when "
                     r"ranks span hosts \(auto: .*cores: ", out), out
    # The environment's mpirun exists but no mpirun is on PATH: a note with the fix, not a problem
    # (torchrun, mp.spawn and srun need none).
    (tmp_path / "nobin").mkdir()
    bad = subprocess.run([sys.executable, "-m", "oneccl_bind_pt.doctor"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**base, "PATH": str(tmp_path / "nobin")})
    assert bad.returncode == 0, bad.stderr
    assert "note: mpirun is not on PATH (needed only to launch with mpirun): source" in bad.stdout, bad.stdout
    assert "setvars.sh" in bad.stdout and "PROBLEM" not in bad.stderr, bad.stderr
    # Another MPI's mpirun first on PATH (Open MPI, MPICH): supported, but named.
    (tmp_path / "otherbin").mkdir()
    (tmp_path / "otherbin" / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "otherbin" / "mpirun").chmod(0o755)
    other = subprocess.run([sys.executable, "-m", "oneccl_bind_pt.doctor"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env={**base, "PATH": str(tmp_path / "otherbin")})
    assert other.returncode == 0, other.stdout + other.stderr
    assert "not this environment's Intel MPI" in other.stdout
    # Another libfabric first on LD_LIBRARY_PATH would be loaded instead of the environment's.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "libfabric.so.1").write_bytes(b"")
    shadow = subprocess.run([sys.executable, "-m", "oneccl_bind_pt.doctor"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={**base, "PATH": f"{bindir}:/usr/bin:/bin", "LD_LIBRARY_PATH": str(tmp_path / "other")})
    assert shadow.returncode == 1
    assert f"LD_LIBRARY_PATH puts another libfabric first ({tmp_path / 'other' / 'libfabric.so.1'})" in shadow.stderr


@pytest.mark.parametrize("shell", [s for s in ("bash", "dash", "zsh") if shutil.which(s)])
def test_conda_activation_sets_and_deactivation_restores(shell, tmp_path):
    """etc/conda/activate.d + deactivate.d scripts, as conda runs them (sourced, CONDA_PREFIX set)."""
    conda = os.path.join(oneccl_bind_pt.cwd, "env", "conda")
    script = f"""
export CONDA_PREFIX="{tmp_path}" CCL_ROOT=/user/ccl FI_PROVIDER_PATH=/user/prov
unset I_MPI_ROOT
. "{conda}/activate.sh"
echo "on $I_MPI_ROOT $CCL_ROOT $FI_PROVIDER_PATH"
. "{conda}/deactivate.sh"
echo "off ${{I_MPI_ROOT-unset}} ${{CCL_ROOT-unset}} ${{FI_PROVIDER_PATH-unset}} $(env | grep -c '^_OBP_')"
unset FI_PROVIDER_PATH
. "{conda}/activate.sh"
echo "fresh $FI_PROVIDER_PATH"
"""
    out = subprocess.run([shell, "-c", script], capture_output=True, text=True, check=True, timeout=120).stdout.split("\n")
    assert out[0] == f"on {tmp_path} {tmp_path} /user/prov"
    assert out[1] == "off unset /user/ccl /user/prov 0"
    assert out[2] == f"fresh {tmp_path}/lib"


def test_extension_symbols_fit_manylinux_2_28():
    """Torch's own tag: no reference to a glibc or libstdc++ symbol version newer than 2.28's
    (src/glibc_compat.cpp wraps the ones a newer build machine binds to)."""
    import_or_require("auditwheel")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import build_wheels

    so = next(Path(oneccl_bind_pt.cwd).glob("_C*.so"))
    assert build_wheels.pinning_symbols(so, "manylinux_2_28_x86_64") == []
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True, timeout=60).stdout
    # glibc 2.28 defines the old pthread/dl versions the wrappers bind to in these libraries.
    assert "[libpthread.so.0]" in needed and "[libdl.so.2]" in needed, needed
