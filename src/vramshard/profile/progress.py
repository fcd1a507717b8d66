"""How the profiler reports progress: a sink with ``start``, ``step`` and ``advance``.

Work is counted in *weights* (expected seconds), so a progress bar can show time left.
The default sink only logs at debug level; the CLI supplies a rich progress bar.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class ProgressSink:
    """Receives the profiler's progress. Subclass and override what you need."""

    def start(self, total_weight: float) -> None:
        """Called once with the expected total work (roughly seconds)."""

    def step(self, label: str) -> None:
        """A new point is being measured; ``label`` says what (``"cpu matmul bf16 M=16 …"``)."""
        log.debug("measuring %s", label)

    def advance(self, weight: float) -> None:
        """The current point is done; it was worth ``weight`` of the total."""
