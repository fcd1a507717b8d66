"""Token tiers: the number of new tokens in one forward step, each with its own plan."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInputError

DECODE_TIERS = (1, 4, 16, 64)
PREFILL_TIERS = (256, 512, 1024, 2048)


@dataclass(frozen=True)
class Tiers:
    """Ascending tier sizes; a step uses the plan of the smallest tier covering its tokens."""

    sizes: tuple[int, ...] = DECODE_TIERS + PREFILL_TIERS

    def __post_init__(self):
        if not self.sizes or any(s <= 0 for s in self.sizes) or list(self.sizes) != sorted(set(self.sizes)):
            raise InvalidInputError(f"tiers must be distinct positive token counts in ascending order, got {self.sizes}")

    @classmethod
    def parse(cls, text: str) -> "Tiers":
        """``"1,4,16,64,256"`` → Tiers."""
        try:
            return cls(tuple(sorted({int(part) for part in text.split(",") if part.strip()})))
        except ValueError:
            raise InvalidInputError(f"tiers must be comma-separated whole numbers, got {text!r}") from None

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def tier_for(self, n_tokens: int) -> int:
        """The smallest tier with at least ``n_tokens`` tokens."""
        if n_tokens <= 0:
            raise InvalidInputError(f"a step needs at least one token, got {n_tokens}")
        for size in self.sizes:
            if n_tokens <= size:
                return size
        raise InvalidInputError(
            f"a step of {n_tokens} tokens is larger than the largest tier ({self.largest}); split it into chunks"
        )
