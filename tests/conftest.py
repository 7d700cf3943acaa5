import os

import pytest

from harness import TRANSPORTS

# `pytest -m quick`: each area once, a few minutes in all (measured: see below). Kept here,
# in one list, so that the tier can be read (and timed) as a whole.
QUICK = (
    "tests/test_package.py::test_three_import_names_are_one_module",            # package import
    "tests/test_shm.py::test_both_transports_in_flight_together",                # both transports
    "tests/test_matrix.py::test_case[all_reduce-SUM-float32-2-oneccl]",          # op x dtype, oneCCL
    "tests/test_vs_gloo.py::test_same_as_gloo[world2-shm-all_gather]",            # collectives vs gloo
    "tests/test_p2p.py::test_recv_matches_by_tag[ccl-staged]",                  # p2p
    "tests/test_async.py::test_wait_timeout_raises_then_op_completes[shm]",     # async
    "tests/test_errors.py::test_group_timeout_raises_instead_of_hanging[shm]",  # errors
    "tests/test_training.py::test_ddp_matches_gloo",                            # DDP training
    "tests/test_launchers.py::test_torchrun_ddp_example",                       # torchrun
    "tests/test_launchers.py::test_mpirun_ddp_example",                         # mpirun
)
# tests/test_other_releases.py builds and proves whole releases: its module fixture alone
# may take hours on a cold cache, above the suite-wide pytest-timeout.
LONG_FILES = {"test_other_releases.py": 4 * 3600}
# The order units start in. Under `pytest -n 2` (the README's test command) two run at once:
# the pairs of test_other_releases.py (4-10 minutes each, much of it pip writing a CUDA torch
# to disk) alternate with the longest files, so the cores stay busy while a pair waits on the
# disk, and the many short files fill the end.

def _unit(nodeid):
    """What one xdist worker runs as a whole: a test file, or one release pair of
    test_other_releases.py (its module fixture is per pair, so pairs can run side by side)."""
    path, _, rest = nodeid.partition("::")
    if os.path.basename(path) == "test_other_releases.py" and "[" in rest:
        return f"{path}[{rest.split('[', 1)[1]}"
    return path


# The longest files after the pairs (measured, under load: conda 6-11 min, DeepSpeed's op
# build 3 min, PyTorch's suite 2 min), interleaved with the pairs so two workers end together.
EARLY_FILES = ("test_conda.py", "test_deepspeed.py", "test_pytorch_suite.py")


def _start_order(items):
    """Sort key: 2k for the k-th (torch, Python) pair (newest torch first), 2k+1 for the k-th of
    EARLY_FILES, then every other file in its order: the long units first, so that the short
    ones fill the end."""
    pairs = sorted({_unit(i.nodeid) for i in items if "[torch" in _unit(i.nodeid)},
                   key=lambda u: [-int(p) for p in u.split("[torch", 1)[1].split("-")[0].split(".")])

    def key(item):
        unit = _unit(item.nodeid)
        if unit in pairs:
            return 2 * pairs.index(unit)
        if item.path.name in EARLY_FILES:
            return 2 * EARLY_FILES.index(item.path.name) + 1
        return 1_000
    return key


def pytest_configure(config):
    # The tests exercise the installed package, never the source tree.
    import oneccl_bind_pt

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.dirname(oneccl_bind_pt.cwd) == here:
        raise pytest.UsageError(
            "oneccl_bind_pt was imported from the source tree; run the tests with "
            "`.venv/bin/pytest tests` from an installed build (./scripts/setup.sh)."
        )


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def transport(request):
    """"shm" or "oneccl": a test that takes it runs once on each transport of one host, with
    env=TRANSPORTS[transport] for its ranks (harness.py). Module scope, so that a module's
    shared fixtures (test_vs_gloo.py's reports) can run once per transport too."""
    return request.param


# The run's closing line counts tests by where their data went (pytest_terminal_summary).
# "cma" (test_matrix.py) is the shared-memory transport reading peers' tensors directly.
TRANSPORT_LINE = {"shm": "shared memory", "oneccl": "oneCCL on one host", "hosts": "oneCCL across hosts",
                  None: "other (no transport named)"}
_ID_WORDS = {"shm": "shm", "cma": "shm", "oneccl": "oneccl"}


def _transport_of(item):
    """"hosts" for a test on a fixture of hosts (two_hosts, ...: every group there is oneCCL's),
    else "shm" / "oneccl" from its `transport`, an ONECCL_BIND_PT_SHM in its parameters, or
    a word of its id; None when none says."""
    if any("hosts" in name for name in getattr(item, "fixturenames", ())):
        return "hosts"
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    if callspec.params.get("transport") in TRANSPORTS:
        return callspec.params["transport"]
    for value in callspec.params.values():
        for env in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(env, dict) and "ONECCL_BIND_PT_SHM" in env:
                return "oneccl" if env["ONECCL_BIND_PT_SHM"] == "0" else "shm"
    words = {_ID_WORDS[w] for w in callspec.id.split("-") if w in _ID_WORDS}
    return words.pop() if len(words) == 1 else None


@pytest.hookimpl(wrapper=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    result = yield  # pytest's own sections first (-ra's list too): this line closes the summary
    # Under xdist this runs in the controller, which has reports but no items: the transport
    # travels on each report as a user property (pytest_collection_modifyitems).
    counts = {}
    for outcome in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"):
        seen = set()
        for report in terminalreporter.stats.get(outcome, ()):
            properties = getattr(report, "user_properties", None)
            if properties is None or report.nodeid in seen:
                continue  # a collection error has none; a test counts once per outcome
            seen.add(report.nodeid)
            where = dict(properties).get("transport")
            counts.setdefault(where, dict.fromkeys(("passed", "failed", "skipped"), 0))
            counts[where][outcome] = counts[where].get(outcome, 0) + 1
    parts = []
    for key, label in TRANSPORT_LINE.items():
        if key is not None or key in counts:
            got = counts.get(key, {"passed": 0, "failed": 0, "skipped": 0})
            parts.append(f"{label}: " + ", ".join(f"{n} {outcome}" for outcome, n in got.items()))
    if counts:
        terminalreporter.write_line("per transport: " + "; ".join(parts))
    # The release pairs' steps (test_other_releases.py): most of a CI run's time.
    took = sorted({value for reports in terminalreporter.stats.values() for report in reports
                   for name, value in getattr(report, "user_properties", None) or () if name == "took"})
    for line in took:
        terminalreporter.write_line(f"took: {line}")
    return result


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the long variants")


@pytest.hookimpl(optionalhook=True)  # the hook exists only with pytest-xdist installed
def pytest_xdist_make_scheduler(config, log):
    # `pytest -n 2` (the README's test command): module fixtures (Slurm's daemons, a pair's
    # venv) are made once, so a unit is a file or a pair, never single tests; and units
    # start in collection order (_start_order), not by their number of tests.
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return ByUnit(config, log)


def _whole_suite(config):
    return all(os.path.basename(os.path.normpath(a)) == "tests" for a in config.args)


def _stale_quick(items_or_ids):
    return sorted(set(QUICK) - {getattr(i, "nodeid", i) for i in items_or_ids})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    # What a worker collected, after -k/-m chose: only a run of everything can tell a stale id.
    config = node.config
    chosen = config.option.keyword or config.option.markexpr or config.option.deselect
    if _whole_suite(config) and not chosen and (stale := _stale_quick(ids)):
        pytest.exit(f"conftest.py QUICK names tests that do not exist: {stale}", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks added here
def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_order(items))  # stable: within a rank, the collection's order
    # Under xdist the workers collect, and a UsageError raised in one shows only as an
    # INTERNALERROR: there the controller checks (below), here a run without xdist does.
    if _whole_suite(config) and not hasattr(config, "workerinput") and (stale := _stale_quick(items)):
        raise pytest.UsageError(f"conftest.py QUICK names tests that do not exist: {stale}")
    for item in items:
        # Copied onto every report of the item, where the controller's summary reads it.
        if where := _transport_of(item):
            item.user_properties.append(("transport", where))
        if item.nodeid in QUICK:
            item.add_marker(pytest.mark.quick)
        seconds = LONG_FILES.get(item.path.name)
        if seconds and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(seconds))
    if config.getoption("--runslow"):
        return
    for item in items:
        if "slow" in item.keywords:
            # Named, so that the summary (-ra) lists each one not run.
            item.add_marker(pytest.mark.skip(reason=f"{item.name} runs with --runslow only"))
