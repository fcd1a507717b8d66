"""How much host memory the CPU's optional copies of weights may take (prepacked parts, row-major
down projections): a share of the memory the host has available when the first copy is made.

Each copy sits beside the plain host weights, which stay the source of every copy to the GPU, so it
is memory the model did not need. Past ``MemAvailable`` the kernel reclaims or kills; a quarter of
it leaves the rest to the KV cache in host memory, the activations and whatever else the machine
runs (a game, on our users' desktops).
"""

from __future__ import annotations

import logging
import threading

from ..host_memory import meminfo_bytes

log = logging.getLogger(__name__)

AVAILABLE_SHARE = 0.25  # the copies' total, at most this share of the host's available memory


def available_host_bytes() -> int | None:
    """The host memory available to new allocations (Linux ``MemAvailable``), None where unknown."""
    return meminfo_bytes("MemAvailable")


class HostAllowance:
    """Bytes one kind of copy may take in all: :data:`AVAILABLE_SHARE` of the available memory,
    fixed at the first copy (None where unknown: no copies), or no limit (``limited=False``).
    ``what`` and ``lift`` name the copies and the setting that lifts the limit, for the log."""

    def __init__(self, what: str, lift: str, limited: bool = True):
        self.what, self.lift, self.limited = what, lift, limited
        self.bytes: int | None = None  # fixed at the first question
        self._said_full = False

    def room_for(self, held: int, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit beside the ``held`` bytes of copies made so far."""
        if not self.limited:
            return True
        if self.bytes is None:
            available = available_host_bytes()
            self.bytes = int(available * AVAILABLE_SHARE) if available is not None else 0
            log.info("%s: copies of up to %.2f GiB (a quarter of the host's available memory)", self.what,
                     self.bytes / 2**30)
        if held + nbytes <= self.bytes:
            return True
        if not self._said_full:
            self._said_full = True
            log.info("%s: the copies' %.2f GiB are full; further parts run from the plain weights (%s lifts "
                     "the limit)", self.what, held / 2**30, self.lift)
        return False


def release_later(dropped: list) -> None:
    """Let go of ``dropped`` (copies no plan in force reads; the list holds their last references) on a
    thread of its own, not the caller's: at a switch the executor's lock holds the steps, and unmapping
    the pages of 0.82 GiB of packed parts took 53-67 ms on the development machine where a loop on
    another thread meanwhile saw no gap over 0.23 ms (session 48)."""
    if dropped:
        threading.Thread(target=dropped.clear, name="vramshard-release", daemon=True).start()
