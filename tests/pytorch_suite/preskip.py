"""Skips, in the parent, the cases whose ranks would only exit with a skip.

About half of ``_DistTestBase`` needs GPUs (``@skip_if_no_gpu``,
``@skip_if_lt_x_gpu(n)``) or at least 8 ranks (``@skip_if_small_worldsize``).
Those decorators decide inside each spawned rank, after it has imported torch
(about 10 s of CPU per case here), and the rank then exits with a skip code.

For a case carrying one of them, ``decided_skip`` runs the decorator's own
wrapper code in the parent, with the test body replaced by a stub: if the
wrapper exits with a skip code, the case is skipped with the message the parent
would have reported after spawning; if it calls the stub, the case runs as
usual. The decorators' logic is not restated here, so it stays right when
PyTorch changes it. Set PYTORCH_SUITE_PRESKIP=0 to spawn every case anyway.
"""

from __future__ import annotations

import os
import types

from torch.testing._internal import common_distributed as cd


def _wrapper_code(decorator):
    return decorator(lambda *args, **kwargs: None).__code__


# Decorators that only look at the machine and the configuration, never at the test.
_DECIDERS = {
    _wrapper_code(cd.skip_if_no_gpu),
    _wrapper_code(cd.skip_if_lt_x_gpu(1)),
    _wrapper_code(cd.skip_if_small_worldsize),
    _wrapper_code(cd.skip_if_odd_worldsize),
}
_MESSAGES = {skip.exit_code: skip.message for skip in cd.TEST_SKIPS.values()}


class _Ran(Exception):
    pass


def _stub(*args, **kwargs):
    raise _Ran


def _probe(fn: types.FunctionType) -> types.FunctionType:
    """fn's code and closure, with the function it wraps replaced by _stub."""
    cells = tuple(
        types.CellType(_stub) if name == "func" else cell
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())
    )
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


def enabled() -> bool:
    return os.environ.get("PYTORCH_SUITE_PRESKIP", "1") != "0"


def decided_skip(test_fn, test_case) -> str | None:
    """The skip message the ranks would report for test_fn, when the parent can tell."""
    fn = test_fn
    while fn is not None:
        if getattr(fn, "__code__", None) in _DECIDERS and "func" in fn.__code__.co_freevars:
            try:
                _probe(fn)(test_case)
            except SystemExit as e:
                if e.code in _MESSAGES:
                    return _MESSAGES[e.code]
            except _Ran:
                pass
        fn = getattr(fn, "__wrapped__", None)
    return None
