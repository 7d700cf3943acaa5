"""Fixes for libraries that drive the ccl backend, applied when they are imported.

DeepSpeed (CPU): ``deepspeed.comm.ccl.CCLBackend.get_all_ranks_from_group``
finds a group's ranks by asking ``torch.distributed.get_global_rank(group, r)``
for r = 0, 1, 2, ... until it raises. For the WORLD group torch returns r for
every r and never raises, so ZeRO-3 (whose parameter broadcasts pass WORLD)
loops forever, growing without bound. WORLD means every rank: we hand it on as
``None``, which the method already answers with ``range(world_size)``.
The fix is applied when that module has loaded: at our import if it is
complete, else as it loads, else (DeepSpeed imports us while its module is
half-initialised) when DeepSpeed creates its ccl group.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_DEEPSPEED_CCL = "deepspeed.comm.ccl"


def _fix_deepspeed_ccl(module) -> None:
    backend = getattr(module, "CCLBackend", None)
    original = getattr(backend, "get_all_ranks_from_group", None)
    if original is None or getattr(original, "_oneccl_bind_pt", False):
        return

    def get_all_ranks_from_group(self, group):
        import torch.distributed as dist

        if group is dist.GroupMember.WORLD:
            group = None
        return original(self, group)

    get_all_ranks_from_group._oneccl_bind_pt = True
    get_all_ranks_from_group.__doc__ = original.__doc__
    backend.get_all_ranks_from_group = get_all_ranks_from_group


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads deepspeed.comm.ccl with the usual finders, then fixes it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DEEPSPEED_CCL:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _fix_deepspeed_ccl(module)


def install() -> None:
    if _DEEPSPEED_CCL in sys.modules:
        _fix_deepspeed_ccl(sys.modules[_DEEPSPEED_CCL])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
