"""Loads PyTorch's distributed test suite with "ccl" admitted wherever "gloo" is.

``torch.testing._internal.distributed.distributed_test`` decides which cases
run from the backend's *name*, at import time (its decorators are evaluated
when the class body runs). It knows nccl, gloo, mpi, ucc and asks about them in
three ways; each is opened to ccl here without touching PyTorch's files:

1. ``DistTestCases.backend_feature`` / ``skip_collective`` (common_distributed):
   sets of backend names. ccl joins every set gloo is in, plus "plugin" (what
   ``require_backend_is_available`` accepts for third-party backends). This is
   done before the module is executed, since its decorators read the sets.
2. Comparisons with a literal: ``BACKEND == "gloo"``, ``BACKEND != "gloo"``,
   ``BACKEND in {..., "gloo"}`` and ``require_backend_is_available({"gloo"})``.
   The module's source is parsed and those nodes alone are rewritten
   (``BACKEND in ("gloo", "ccl")``); the result is compiled under the original
   file name, with the original line numbers, and imported under a private
   name (``MODULE_NAME``). PyTorch's module on disk and in ``sys.modules`` is
   left alone.
3. Lists of ``dist.Backend.GLOO``-style constants compared at run time with
   ``dist.get_backend()`` (the profiling allowlists): ccl is added to each.

Comparisons that look at something other than the configured backend name
(``ddp_logging_data["backend_name"] == "gloo"``, groups created with
``backend="gloo"``) are not touched: those cases really are about gloo.

Every rewrite is recorded in ``REWRITES`` (line number and the original
source) so a PyTorch release that changes these gates shows up as a changed
count rather than as silently skipped cases.

The same transformed module is used for the gloo baseline, so both backends run
identical code; for BACKEND=gloo the rewrites change nothing.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import marshal
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ADMITTED = "ccl"
LIKE = "gloo"
TORCH_MODULE = "torch.testing._internal.distributed.distributed_test"
MODULE_NAME = "pytorch_suite._distributed_test"
# Names a file where the first process stores the transformed code for the others.
CODE_CACHE = "PYTORCH_SUITE_CODE_CACHE"


@dataclass(frozen=True)
class Rewrite:
    kind: str  # "compare", "call" or "list"
    line: int
    source: str


# What load() rewrote in this process.
REWRITES: list[Rewrite] = []


def _is_backend_name(node: ast.AST) -> bool:
    """BACKEND, or os.environ["BACKEND"]: the backend the suite was started for."""
    if isinstance(node, ast.Name):
        return node.id == "BACKEND"
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "environ"
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == "BACKEND"
    )


def _is_like(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == LIKE


def _is_like_constant(node: ast.AST) -> bool:
    """dist.Backend.GLOO / Backend.GLOO."""
    return isinstance(node, ast.Attribute) and node.attr == LIKE.upper() and (
        (isinstance(node.value, ast.Name) and node.value.id == "Backend")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "Backend")
    )


def _admitted() -> ast.Constant:
    return ast.Constant(ADMITTED)


class _AdmitLikeGloo(ast.NodeTransformer):
    def __init__(self, source: str):
        self.lines = source.splitlines()
        self.rewrites: list[Rewrite] = []

    def _record(self, kind: str, node: ast.AST) -> None:
        self.rewrites.append(Rewrite(kind, node.lineno, self.lines[node.lineno - 1].strip()))

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) != 1:
            return node
        left, op, right = node.left, node.ops[0], node.comparators[0]
        if _is_like(left) and isinstance(op, (ast.Eq, ast.NotEq)):
            left, right = right, left  # "gloo" == BACKEND
        if not _is_backend_name(left):
            return node
        if _is_like(right) and isinstance(op, (ast.Eq, ast.NotEq)):
            self._record("compare", node)
            new_op = ast.In() if isinstance(op, ast.Eq) else ast.NotIn()
            members = ast.Tuple([ast.Constant(LIKE), _admitted()], ast.Load())
            return ast.copy_location(ast.Compare(left, [new_op], [members]), node)
        if isinstance(op, (ast.In, ast.NotIn)) and self._widen(right):
            self._record("compare", node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name == "require_backend_is_available" and node.args and self._widen(node.args[0]):
            self._record("call", node)
        return node

    def visit_List(self, node: ast.List) -> ast.AST:
        self.generic_visit(node)
        if any(_is_like_constant(e) for e in node.elts):
            self._record("list", node)
            node.elts.append(_admitted())
        return node

    @staticmethod
    def _widen(collection: ast.AST) -> bool:
        """Adds ccl to a literal set/list/tuple of names that holds gloo."""
        if isinstance(collection, (ast.Set, ast.List, ast.Tuple)) and any(_is_like(e) for e in collection.elts):
            if not any(isinstance(e, ast.Constant) and e.value == ADMITTED for e in collection.elts):
                collection.elts.append(_admitted())
            return True
        return False


def _admit_in_test_cases() -> None:
    from torch.testing._internal.common_distributed import DistTestCases

    for table in (DistTestCases.backend_feature, DistTestCases.skip_collective):
        for names in table.values():
            if LIKE in names:
                names.add(ADMITTED)
    DistTestCases.backend_feature.setdefault("plugin", set()).add(ADMITTED)


def _transform(source: str, origin: str):
    """The module's code with ccl admitted, and the list of what was rewritten."""
    transformer = _AdmitLikeGloo(source)
    tree = transformer.visit(ast.parse(source, origin))
    # dont_inherit: this file's `from __future__ import annotations` must not leak into torch's
    # module (DDP checks a comm hook's annotations against dist.GradBucket itself, not a string).
    return compile(ast.fix_missing_locations(tree), origin, "exec", dont_inherit=True), transformer.rewrites


def _compiled(source: str, origin: str):
    """The transformed code, through the file CODE_CACHE names when it is set.

    Every case spawns fresh rank processes that each import this suite; the
    runner points them at one file so the transform runs once per run, not
    twice per case (it costs about a second of CPU).
    """
    path = os.environ.get(CODE_CACHE)
    key = hashlib.sha256(
        importlib.util.MAGIC_NUMBER + source.encode() + Path(__file__).read_bytes()
    ).hexdigest()
    if path:
        try:
            stored_key, rewrites, code = marshal.loads(Path(path).read_bytes())
            if stored_key == key:
                return code, [Rewrite(*r) for r in rewrites]
        except (OSError, ValueError, EOFError, TypeError):
            pass
    code, rewrites = _transform(source, origin)
    if path:
        data = marshal.dumps((key, [(r.kind, r.line, r.source) for r in rewrites], code))
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_bytes(data)
        os.replace(tmp, path)
    return code, rewrites


def load():
    """The transformed distributed_test module (executed once per process)."""
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    _admit_in_test_cases()
    spec = importlib.util.find_spec(TORCH_MODULE)
    code, rewrites = _compiled(Path(spec.origin).read_text(encoding="utf-8"), spec.origin)
    REWRITES[:] = rewrites

    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(MODULE_NAME, loader=None))
    module.__file__ = spec.origin
    sys.modules[MODULE_NAME] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module
