import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: directory of a saved tiny model of the named architecture (cached per session)."""
    made = {}

    def get(name: str, dtype: torch.dtype = torch.float32) -> Path:
        key = (name, dtype)
        if key not in made:
            made[key] = make_tiny(name, tmp_path_factory.mktemp(f"{name}_{str(dtype).split('.')[-1]}"), dtype=dtype)
        return made[key]

    return get


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
