import os

import pytest

# `pytest -m quick`: each area once, a few minutes in all (measured: see below). Kept here,
# in one list, so that the tier can be read (and timed) as a whole.
QUICK = (
    "tests/test_package.py::test_three_import_names_are_one_module",            # package import
    "tests/test_shm.py::test_both_transports_in_flight_together",                # both transports
    "tests/test_matrix.py::test_case[all_reduce-SUM-float32-2-oneccl]",          # op x dtype, oneCCL
    "tests/test_vs_gloo.py::test_same_as_gloo[world2-all_gather]",                # collectives vs gloo
    "tests/test_p2p.py::test_recv_matches_by_tag[ccl]",                         # p2p
    "tests/test_async.py::test_wait_timeout_raises_then_op_completes",          # async
    "tests/test_errors.py::test_group_timeout_raises_instead_of_hanging",       # errors
    "tests/test_training.py::test_ddp_matches_gloo",                            # DDP training
    "tests/test_launchers.py::test_torchrun_ddp_example",                       # torchrun
    "tests/test_launchers.py::test_mpirun_ddp_example",                         # mpirun
)
# tests/test_other_releases.py builds and proves whole releases: its module fixture alone
# may take hours on a cold cache, above the suite-wide pytest-timeout.
LONG_FILES = {"test_other_releases.py": 4 * 3600}


def pytest_configure(config):
    # The tests exercise the installed package, never the source tree.
    import oneccl_bind_pt

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.dirname(oneccl_bind_pt.cwd) == here:
        raise pytest.UsageError(
            "oneccl_bind_pt was imported from the source tree; run the tests with "
            "`.venv/bin/pytest tests` from an installed build (./scripts/setup.sh)."
        )


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the long variants")


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks added here
def pytest_collection_modifyitems(config, items):
    if all(os.path.basename(os.path.normpath(a)) == "tests" for a in config.args):  # the whole suite
        stale = set(QUICK) - {item.nodeid for item in items}
        if stale:
            raise pytest.UsageError(f"conftest.py QUICK names tests that do not exist: {sorted(stale)}")
    for item in items:
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
            item.add_marker(pytest.mark.skip(reason=f"{item.name} is a long variant: pass --runslow"))
