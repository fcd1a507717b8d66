"""Markdown pieces of the report: numbers, tables, footnoted reasons, the generated block's markers."""

from __future__ import annotations

import re

BEGIN = "<!-- report:begin -->"
END = "<!-- report:end -->"


def num(value, digits: int = 3) -> str:
    """A number with ``digits`` significant digits ("—" for None); no exponents."""
    if value is None:
        return "—"
    value = float(value)
    if value != value:  # NaN
        return "—"
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    text = f"{value:.{digits}g}"
    return f"{float(text):f}".rstrip("0").rstrip(".") if "e" in text else text


def ratio(value) -> str:
    return "—" if value is None else f"{value:.2f}×"


def pct(value) -> str:
    return "—" if value is None else f"{value:+.0f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def first_sentence(text: str, limit: int = 240) -> str:
    """A reason short enough for a footnote: its first line, cut at ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Footnotes:
    """Reasons why cells could not run, numbered once each; cells show ``n/a [k]``."""

    def __init__(self):
        self.reasons: dict[str, int] = {}

    def mark(self, reason: str) -> str:
        reason = first_sentence(reason)
        if reason not in self.reasons:
            self.reasons[reason] = len(self.reasons) + 1
        return f"n/a [{self.reasons[reason]}]"

    def render(self) -> str:
        return "\n".join(f"- [{k}] {reason}" for reason, k in self.reasons.items())


def splice(document: str, generated: str) -> str:
    """``document`` with the text between the report markers replaced by ``generated`` (markers
    kept); without markers, the block is appended after the hand-written text."""
    block = f"{BEGIN}\n{generated.strip()}\n{END}"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if pattern.search(document):
        return pattern.sub(lambda _: block, document, count=1)
    return document.rstrip("\n") + "\n\n" + block + "\n"
