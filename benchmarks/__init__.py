"""Benchmark scripts: ``python -m benchmarks.NAME`` (see benchmarks/README.md)."""

import os as _os

# Each benchmark run starts from the machine profile as measured: the factors an engine fits to
# its own steps stay in its process, not in the calibration file a later run would start from
# (vramshard/profile/learned.py). Set VRAMSHARD_CALIBRATION_STORE=on to measure with the file.
_os.environ.setdefault("VRAMSHARD_CALIBRATION_STORE", "off")
