"""Exceptions the ccl backend raises for bad arguments.

gloo and NCCL raise ``RuntimeError`` for a bad argument, and code written for
them catches ``RuntimeError``. These are ``torch.distributed.DistBackendError``
(a ``RuntimeError``) and also ``ValueError`` / ``TypeError``, so code that
catches either kind keeps working. The message names the op, what was wrong
and what is expected.
"""

from torch.distributed import DistBackendError


class ArgumentError(DistBackendError, ValueError):
    """A collective got a value, shape or rank it cannot accept."""


class ArgumentTypeError(DistBackendError, TypeError):
    """A collective got a dtype it cannot handle (or dtypes that disagree)."""
