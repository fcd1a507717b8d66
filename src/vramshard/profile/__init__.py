"""Profile: install-time measurement of this machine, stored and queried by the estimator.

- :func:`run_profile` with a :class:`BenchmarkSpec` measures (``vramshard profile``);
- :func:`save`, :func:`load`, :func:`load_or_none` handle the file in the cache directory;
- :class:`Profile` answers ``matmul_s``, ``transfer_s``, ``attention_s``, ``dispatch_s``;
- :func:`synthetic` builds a Profile from peak numbers (for tests and what-ifs).

Importing this package does not import torch; :func:`run_profile` does.
"""

# Load the submodule `synthetic` first: importing it later (Profile.synthetic does) would
# otherwise replace the package attribute `synthetic`, the function below, with the module.
from . import synthetic as _synthetic_module  # noqa: F401
from .query import Profile, synthetic
from .spec import BenchmarkSpec, projection_shapes
from .store import load, load_or_none, profile_path, save

__all__ = [
    "BenchmarkSpec", "Profile", "load", "load_or_none", "profile_path", "projection_shapes",
    "run_profile", "save", "synthetic",
]


def __getattr__(name):
    if name == "run_profile":
        from .runner import run_profile

        return run_profile
    raise AttributeError(name)
