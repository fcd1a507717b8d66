"""Fingerprint of the machine a profile was measured on, and its stable hash.

The fingerprint names what changes the measured speeds: CPU model, core count, memory
size, GPU name and driver, torch version. A profile is only reused on a machine with the
same fingerprint hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
from pathlib import Path

from ..host_memory import meminfo_bytes

log = logging.getLogger(__name__)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_gib() -> int:
    """Total host memory rounded to whole GiB (rounding keeps the hash stable)."""
    total = meminfo_bytes("MemTotal")
    if total is not None:
        return round(total / 2**30)
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):
        return 0


def _nvidia_driver() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+([0-9.]+)", text) or re.search(r"\s([0-9]{3,}\.[0-9.]+)\s", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip().splitlines()
        if out:
            return out[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def machine_fingerprint() -> dict:
    """What identifies this machine's speed: a plain JSON-able dict.

    Keys: ``cpu_model``, ``cpu_count`` (logical CPUs), ``memory_gib``, ``torch``,
    ``gpu_name`` and ``gpu_driver`` (``None`` without CUDA), ``cuda`` (torch's CUDA version).
    """
    import torch

    fingerprint = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count() or 1,
        "memory_gib": _memory_gib(),
        "torch": torch.__version__,
        "gpu_name": None,
        "gpu_driver": None,
        "cuda": None,
    }
    if torch.cuda.is_available():
        fingerprint["gpu_name"] = torch.cuda.get_device_name(0)
        fingerprint["gpu_driver"] = _nvidia_driver()
        fingerprint["cuda"] = torch.version.cuda
    return fingerprint


def fingerprint_hash(fingerprint: dict) -> str:
    """Stable 16-hex-digit hash of a fingerprint (order of keys does not matter)."""
    canonical = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def describe_difference(expected: dict, found: dict) -> str:
    """``"gpu_name: 'A' here, 'B' in file; ..."`` for the keys that differ."""
    keys = sorted(set(expected) | set(found))
    parts = [
        f"{key}: {expected.get(key)!r} here, {found.get(key)!r} in file"
        for key in keys
        if expected.get(key) != found.get(key)
    ]
    return "; ".join(parts) or "no field differs"
