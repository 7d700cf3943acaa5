"""PyTorch's own distributed test suite, run against ccl with gloo as the baseline.

PyTorch ships the suite in its wheel (``torch.testing._internal.distributed.
distributed_test``, class ``DistributedTest._DistTestBase``) and runs it from
``test/distributed/test_distributed_spawn.py``, which is not in the wheel:
BACKEND, WORLD_SIZE, TEMP_DIR and INIT_METHOD in the environment, one test
class per backend, each case spawning WORLD_SIZE real rank processes. This
package does the same for "gloo" and "ccl":

loader.py            imports torch's module with ccl admitted wherever gloo is
                     (the suite gates cases on backend *names*); PyTorch's
                     files are not modified.
distributed_spawn.py the test module, test_distributed_spawn.py's counterpart.
preskip.py           skips in the parent the cases whose ranks would only
                     exit with "needs GPUs" / "needs 8 ranks" (half the suite).
runner.py            runs distributed_spawn.py in its own pytest process for
                     one backend and world size; reads each case's outcome.
inventory.py         lists the cases and their skips without spawning.
compare.py           ccl against gloo, with known_issues.py applied.
known_issues.py      the cases known not to pass on ccl, with category and reason.
selection.py         the plans: ci-ws2 and ci-ws3 (default), full-ws2 and
                     full-ws3 (--runslow), smoke (for another release).
check.py             a plan's pass/fail rule, shared by pytest and the CLI.
report.py            markdown tables from saved runs.

By hand, from tests/ (the runs take minutes to tens of minutes)::

    ../.venv/bin/python -m pytorch_suite run --backend gloo ccl --world-size 2 --out /tmp/suite
    ../.venv/bin/python -m pytorch_suite run --backend ccl --world-size 2 --case test_barrier test_gather --out /tmp/suite
    ../.venv/bin/python -m pytorch_suite report /tmp/suite --markdown /tmp/suite/report.md
    ../.venv/bin/python -m pytorch_suite check --plan smoke

or through pytest: ``.venv/bin/pytest tests/test_pytorch_suite.py`` (the ci
plans), with ``--runslow`` for the whole suite at world sizes 2 and 3.
"""
