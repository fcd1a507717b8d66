"""On/off switches and numbers read from the environment (``VRAMSHARD_*``; the README lists them)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ON = ("on", "1", "true", "yes")
OFF = ("off", "0", "false", "no")


def switch(name: str, default: bool) -> bool:
    """``$name`` as on (on, 1, true, yes) or off (off, 0, false, no), in any case; ``default``
    when unset, or when set to anything else (with a warning that names the variable)."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    value = value.strip().lower()
    if value in ON or value in OFF:
        return value in ON
    log.warning("%s=%r is neither on nor off: using %s", name, value, "on" if default else "off")
    return default


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """``$name`` as one of ``choices`` (in any case; on/off spelled as :func:`switch` takes them);
    ``default`` when unset, or when set to anything else (with a warning that names the variable)."""
    value = (os.environ.get(name) or "").strip().lower()
    if not value:
        return default
    if value not in choices and "on" in choices and "off" in choices and (value in ON or value in OFF):
        value = "on" if value in ON else "off"
    if value in choices:
        return value
    log.warning("%s=%r is none of %s: using %s", name, value, ", ".join(choices), default)
    return default


def number(name: str, default: float, minimum: float = 0.0) -> float:
    """``$name`` as a number of at least ``minimum``; ``default`` when unset, or when set to anything
    else (with a warning that names the variable)."""
    value = (os.environ.get(name) or "").strip()
    if not value:
        return default
    try:
        parsed = float(value)
    except ValueError:
        parsed = None
    if parsed is None or not parsed >= minimum:  # (NaN too)
        log.warning("%s=%r is not a number of at least %g: using %g", name, value, minimum, default)
        return default
    return parsed


def cpu_gemv_rows() -> int:
    """``$VRAMSHARD_CPU_GEMV_ROWS``: the most rows of dense FFN work the C kernel takes (1-4, 4 unset).
    Read here, without torch, so that the kernel (layers/cpu_gemv.FFN_ROWS) and the profile's reading of
    its fitted CPU factors (profile/query.KERNEL_ROWS) draw the line between its rows and torch's at
    the same place."""
    return int(choice("VRAMSHARD_CPU_GEMV_ROWS", ("1", "2", "3", "4"), "4"))
