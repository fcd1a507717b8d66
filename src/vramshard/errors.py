"""Errors vramshard raises for bad input.

Every error a user can trigger derives from :class:`VramshardError`; the CLI
prints its message and exits with its ``exit_code`` instead of a traceback.
"""


class VramshardError(Exception):
    """Base class: a problem with the user's input or machine, not a bug."""

    exit_code = 1


class ModelLoadError(VramshardError):
    """The model directory or file is missing, incomplete, corrupt or unsupported."""

    exit_code = 2


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture vramshard does not implement."""


class InvalidInputError(VramshardError, ValueError):
    """A request is malformed: token id out of range, prompt too long, bad size string."""

    exit_code = 3


class BudgetError(VramshardError):
    """The VRAM budget is too small for what was asked; the message says how much is needed."""

    exit_code = 4


class HostMemoryError(BudgetError):
    """The host has too little memory available for the model's weights; the message says how much
    is needed and how much there is."""


class ProfileError(VramshardError):
    """A profile file is corrupt, foreign to this machine, or missing."""

    exit_code = 5
