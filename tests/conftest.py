import os

import pytest


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


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="long variant: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
