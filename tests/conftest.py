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


@pytest.fixture(scope="session")
def cpu_qwen3(tiny_model_dir):
    """The tiny Qwen3 model on the CPU (float32): the scheduler tests' engine."""
    from vramshard import Engine

    return Engine.load(tiny_model_dir("qwen3"), device="cpu")


@pytest.fixture(scope="session")
def cpu_demo(tmp_path_factory):
    """The demo model (with a tokenizer) on the CPU, float32."""
    from vramshard import Engine
    from vramshard.demo_model import ensure_demo_model

    return Engine.load(ensure_demo_model(tmp_path_factory.mktemp("cache")), device="cpu", dtype="float32")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """Each test's cache directory is its own (profiles, fitted calibration factors): tests
    neither read nor write the user's."""
    monkeypatch.setenv("VRAMSHARD_CACHE", str(tmp_path / "vramshard-cache"))


@pytest.fixture(autouse=True)
def _nothing_learned_across_tests():
    """Engines of one process start from the CPU factors an earlier one fitted on the same
    profile (plan/calibrate.py); each test starts from none."""
    from vramshard.plan import calibrate

    calibrate.forget_learned()
    yield
    calibrate.forget_learned()


@pytest.fixture(autouse=True)
def _load_beside_not_followed(monkeypatch):
    """An engine does not follow the load beside it (runtime/host_load.py) in tests: the test's other
    processes (a server's client) and the machine's would change its threads, and so the rounding of
    its sums, at moments of their own. tests/test_host_load.py gives its engines readings instead."""
    from vramshard.runtime import host_load

    monkeypatch.setattr(host_load, "ENABLED", False)
    monkeypatch.setenv("VRAMSHARD_FOLLOW_HOST_LOAD", "off")


@pytest.fixture(scope="session")
def bf16_llama(tmp_path_factory) -> str:
    """A small bf16 Llama (three layers) whose FFN matrices span whole coded blocks (256 x 1024: 64 blocks
    each): the codecs' GPU tests (tests/test_wire_codec.py, tests/test_vram_coded.py)."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("bf16_llama")
    model.save_pretrained(path)
    return str(path)
