"""vramshard: run LLMs whose weights exceed the VRAM you can spare.

The public API is :class:`Engine` (``Engine.load``, ``engine.logits``, ``engine.generate``).
"""

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]


def __getattr__(name):
    # Lazy: importing vramshard must not import torch for `vramshard --help`.
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
