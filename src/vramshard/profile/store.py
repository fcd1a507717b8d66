"""The profile file: JSON in the user cache directory, keyed by the machine fingerprint.

``save`` writes atomically (temporary file in the same directory, then ``os.replace``), so
an interrupted run never leaves a half-written profile. ``load`` checks the schema and the
fingerprint and raises :class:`ProfileError` with what to do; ``load_or_none`` is for
commands that can run without a profile.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from ..errors import ProfileError
from ..paths import cache_dir
from .fingerprint import describe_difference, fingerprint_hash, machine_fingerprint
from .query import Profile

log = logging.getLogger(__name__)


def profile_path(hash_: str | None = None) -> Path:
    """``cache_dir()/profile-<hash>.json``; the hash defaults to this machine's."""
    if hash_ is None:
        hash_ = fingerprint_hash(machine_fingerprint())
    return cache_dir() / f"profile-{hash_}.json"


def save(profile: Profile, path: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` to ``path`` (default :func:`profile_path` of its fingerprint) atomically."""
    target = Path(path) if path is not None else profile_path(profile.fingerprint_hash)
    text = json.dumps(profile.to_dict(), separators=(",", ":"))
    write_atomically(target, text)
    log.info("wrote profile %s (%d bytes)", target, len(text))
    return target


def write_atomically(target: Path, text: str) -> None:
    """``text`` into ``target`` through a temporary file in the same directory and ``os.replace``:
    readers see the old file or the new one, never half of one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        with _ignore_missing():
            os.unlink(tmp_name)
        raise


class _ignore_missing:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, FileNotFoundError)


def load(path: str | os.PathLike | None = None, fingerprint: dict | None = None, check_fingerprint: bool = True) -> Profile:
    """Read and validate a profile; by default this machine's, from the cache directory.

    Raises ProfileError if the file is missing, corrupt, or (with ``check_fingerprint``)
    was measured on a machine with a different fingerprint (``fingerprint`` defaults to this
    machine's).
    """
    if fingerprint is None and (check_fingerprint or path is None):
        fingerprint = machine_fingerprint()
    target = Path(path) if path is not None else profile_path(fingerprint_hash(fingerprint))
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        raise ProfileError(f"no profile at {target}; run `vramshard profile` to measure this machine") from None
    except OSError as exc:
        raise ProfileError(f"cannot read profile {target}: {exc}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(
            f"profile {target} is corrupt (not valid JSON: {exc}); delete it and run `vramshard profile` again"
        ) from None
    try:
        profile = Profile.from_dict(data)
    except ProfileError as exc:
        raise ProfileError(
            f"profile {target} is corrupt or from another version ({exc}); delete it and run `vramshard profile` again"
        ) from None
    if check_fingerprint:
        expected = fingerprint_hash(fingerprint)
        stored = data.get("fingerprint", {})
        if data.get("fingerprint_hash") != expected or fingerprint_hash(stored) != expected:
            raise ProfileError(
                f"profile {target} was measured on a different machine ({describe_difference(fingerprint, stored)}); "
                "run `vramshard profile` to measure this one"
            )
    return profile


def load_or_none(fingerprint: dict | None = None) -> Profile | None:
    """This machine's profile from the cache directory, or None if there is none.

    Logs a notice when only profiles of other machines exist, and a warning (and returns
    None) when this machine's file is corrupt.
    """
    fingerprint = fingerprint or machine_fingerprint()
    target = profile_path(fingerprint_hash(fingerprint))
    if not target.exists():
        others = sorted(p.name for p in cache_dir().glob("profile-*.json")) if cache_dir().is_dir() else []
        if others:
            log.warning(
                "no profile for this machine (fingerprint %s) but found %s from another machine or setup; "
                "run `vramshard profile` to measure this one", target.stem.removeprefix("profile-"), ", ".join(others),
            )
        return None
    try:
        return load(target, fingerprint)
    except ProfileError as exc:
        log.warning("ignoring profile: %s", exc)
        return None
