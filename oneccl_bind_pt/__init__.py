"""oneCCL backend for torch.distributed.

``import oneccl_bind_pt`` (or ``oneccl_bindings_for_pytorch``, or ``torch_ccl``)
registers the ``ccl`` backend: ``torch.distributed.init_process_group("ccl")``.
"""

import atexit
import multiprocessing.util as _mp_util
import os
import threading

from ._version import RELEASES as _RELEASES
from ._version import TORCH_VERSION as _TORCH_VERSION
from ._version import __version__, release_for

# The installed package folder; env/setvars.sh lives under it.
cwd = os.path.dirname(os.path.abspath(__file__))


def supported_releases():
    """Every release of this package, oldest first: its version, the torch it is built
    with, the torch versions it accepts (pip requirement) and its oneCCL / Intel MPI
    runtime / tcmlib (hwloc) pins."""
    return [dict(row) for row in _RELEASES.values()]


def _same_minor(a, b):
    """torch keeps its C++ ABI within a minor release (the conda package pins x.y)."""
    return a.split("+")[0].split(".")[:2] == b.split("+")[0].split(".")[:2]


def _public(version):
    """'2.14.1+cpu' -> '2.14.1': what `pip install oneccl_bind_pt==...` takes."""
    return version.split("+")[0]


def _check_torch():
    import torch

    try:
        from ._build_info import TORCH_BUILT_WITH
    except ImportError:  # a source tree nobody built
        TORCH_BUILT_WITH = _TORCH_VERSION
    if _same_minor(torch.__version__, TORCH_BUILT_WITH):
        return
    keep = f"pip install torch=={_public(TORCH_BUILT_WITH)}"
    match = release_for(torch.__version__)
    if match is not None:
        fix = (f"For torch {torch.__version__} install oneccl_bind_pt {match['version']} "
               f"(pip install oneccl_bind_pt=={_public(match['version'])}), or keep this build with its torch "
               f"({keep}), or rebuild oneccl_bind_pt against this torch (pip install --no-build-isolation .).")
    else:
        pairs = ", ".join(f"torch {r['torch'].rsplit('.', 1)[0]} -> oneccl_bind_pt {_public(r['version'])}"
                          for r in _RELEASES.values())
        fix = (f"No oneccl_bind_pt release supports torch {torch.__version__} (releases: {pairs}). "
               f"Install the matching torch ({keep}) or a supported torch with its oneccl_bind_pt.")
    raise ImportError(
        f"oneccl_bind_pt {__version__} was built against torch {TORCH_BUILT_WITH}, "
        f"but torch {torch.__version__} is installed. {fix}"
    )


_check_torch()

import torch.distributed as _dist  # noqa: E402

try:
    from . import _C  # noqa: E402
except ImportError as e:
    raise ImportError(
        f"oneccl_bind_pt's compiled extension could not be loaded from {cwd} ({e}). "
        "If that folder is a source checkout, run Python from another directory so the "
        "installed package is imported; otherwise reinstall: pip install --no-build-isolation ."
    ) from e
from ._env import apply_ccl_defaults as _apply_ccl_defaults  # noqa: E402
from ._env import post_answers as _post_answers  # noqa: E402
from .errors import ArgumentError, ArgumentTypeError  # noqa: E402
from ._launchers import map_launcher_env as _map_launcher_env  # noqa: E402

_C._register_error_types(ArgumentError, ArgumentTypeError)
ProcessGroupCCL = _C.ProcessGroupCCL
launcher = _map_launcher_env()
_defaults_applied = False
_defaults_lock = threading.Lock()


def _new_defaults_lock():
    global _defaults_lock
    _defaults_lock = threading.Lock()  # one held by another thread at a fork would stay held


os.register_at_fork(after_in_child=_new_defaults_lock)


def _before_group(store, rank, size, timeout):
    """Called by every ProcessGroupCCL construction, init_process_group's and one built
    directly (torch-ccl's usage), with this creation's keys: oneCCL's defaults, before the
    process's first group."""
    global _defaults_applied
    # Two threads making groups: one sets them, the other finds them set (within its timeout).
    if not _defaults_lock.acquire(timeout=timeout.total_seconds()):
        raise _dist.DistBackendError(f"ccl: another thread of this process was still setting oneCCL's defaults "
                                     f"for its first process group after this group's timeout ({timeout})")
    try:
        if _defaults_applied:
            _post_answers(store, rank)  # for ranks of this group whose first ccl group it is
            return
        try:
            _apply_ccl_defaults(store, rank, size, timeout=timeout)
        except Exception as e:  # a bad ONECCL_BIND_PT_WORKERS: fail the other ranks at once too
            _C._announce_failure(store, rank, getattr(e, "announce", None) or str(e))
            raise
        _defaults_applied = True
    finally:
        _defaults_lock.release()
    # DeepSpeed imports us from inside its own comm module, before that module
    # has defined what the fix patches; by now it has.
    _integrations.install()


_C._set_before_group(_before_group)


def _create_backend(store, rank, size, timeout):
    return ProcessGroupCCL(store, rank, size, timeout)


if "ccl" not in _dist.Backend.backend_list:
    _dist.Backend.register_backend("ccl", _create_backend, devices=["cpu"])
# For code that builds the backend itself, as with torch-ccl.
_dist.ProcessGroupCCL = ProcessGroupCCL

atexit.register(_C._shutdown)


def _at_child_exit(_=None):
    # A multiprocessing child ends in os._exit, past atexit and libfabric's own cleanup;
    # its exit runs these finalizers. (Not _shutdown: a forked child has no progress thread.)
    _mp_util.Finalize(None, _C._child_exit, exitpriority=-100)


_at_child_exit()
_mp_util.register_after_fork(_C, _at_child_exit)

from . import _integrations  # noqa: E402

_integrations.install()

__all__ = ["ArgumentError", "ArgumentTypeError", "ProcessGroupCCL", "__version__", "cwd", "launcher",
           "release_for", "supported_releases"]
