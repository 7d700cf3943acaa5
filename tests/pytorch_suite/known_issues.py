"""Cases of PyTorch's suite that pass on gloo and are known not to on ccl, each with its reason.

Categories:
  BUG   a ccl backend bug or missing feature (wrong result, wrong exception
        type, no sequence numbers, hang): remove the entries with the fix.
  GLOO  the case tests a gloo-only feature, or PyTorch decides the outcome
        from the backend's type: it cannot pass on a third-party backend.
  GATE  the case is skipped or changed only because of the backend's name, in
        a way loader.py does not open (none today).

compare.py fails a ccl run on a difference from gloo not listed here, and on a
listed case that now does as well as gloo, so a fix also updates this list.
Checked against torch 2.13.0 at world sizes 2 and 3: every other case gloo
passes on CPU passes on ccl. An entry holds on both transports unless it names one.
"""

from __future__ import annotations

from dataclasses import dataclass

BUG, GLOO, GATE = "a: ccl bug", "b: gloo-only / decided by backend type", "c: name gate"


@dataclass(frozen=True)
class Known:
    category: str
    reason: str
    world_sizes: tuple[int, ...] = (2, 3)
    # Where the ccl group's data goes (selection.Plan.transport): the package's shared memory,
    # or oneCCL (ONECCL_BIND_PT_SHM=0, and every group across hosts).
    transports: tuple[str, ...] = ("shm", "oneccl")
    # The case hangs until killed: the runner gives it a short case timeout
    # (gloo passes each of these in well under a minute).
    hangs: bool = False


def known_for(world_size: int, transport: str) -> dict[str, Known]:
    """The entries that apply to a run at world_size on transport."""
    return {name: k for name, k in KNOWN.items() if world_size in k.world_sizes and transport in k.transports}


HANG_TIMEOUT = 90  # seconds, for the cases marked hangs=True


def _issue(category: str, reason: str, *cases: str, **kwargs) -> dict[str, Known]:
    return {case: Known(category, reason, **kwargs) for case in cases}


KNOWN: dict[str, Known] = {
    **_issue(
        GLOO,
        'DDP logs ProcessGroup.getBackendName(), which PyTorch derives from the backend type: "custom" '
        "for every backend registered through Backend.register_backend (it always sets "
        'BackendType.CUSTOM; no registration option changes that); the test expects "ccl".',
        "test_ddp_logging_data_cpu",
    ),
    **_issue(
        GLOO,
        "monitored_barrier is gloo-only in PyTorch: distributed_c10d raises \"monitored_barrier is only "
        'implemented for GLOO backend" before reaching the backend, and c10d::Backend::monitoredBarrier '
        '"only GLOO supports monitored barrier".',
        "test_monitored_barrier_gloo",
        "test_monitored_barrier_gloo_subgroup",
        "test_monitored_barrier_gloo_rank_0_timeout",
    ),
    **_issue(
        BUG,
        "On the oneCCL path a receive from any source (src=None) is refused: oneCCL has no "
        "wildcard receive. The package raises ArgumentError before posting anything, and the "
        "group stays usable (docs/migration.md); on shared memory it is supported.",
        "test_send_recv_any_source",
        "test_send_recv_any_source_autograd_profiler",
        "test_send_recv_any_source_torch_profiler",
        transports=("oneccl",),
    ),
}


def hang_timeouts() -> dict[str, int]:
    """Case timeouts for the known hangs (PyTorch's TIMEOUT_OVERRIDE mechanism)."""
    return {case: HANG_TIMEOUT for case, known in KNOWN.items() if known.hangs}
