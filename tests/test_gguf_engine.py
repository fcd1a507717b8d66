"""Every architecture through GGUF (written by the gguf package) gives the transformers logits."""

import pytest
import torch
import transformers

from tiny_models import ARCHS
from vramshard import Engine
from vramshard.loading.checkpoint import open_checkpoint
from vramshard.loading.gguf_io import write_gguf

PROMPT = [5, 17, 42, 3, 77, 12, 9, 60, 31, 2, 88, 14]


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_logits_match_transformers(arch, tiny_model_dir, tmp_path):
    path = tiny_model_dir(arch)
    gguf_path = tmp_path / f"{arch}.gguf"
    write_gguf(gguf_path, open_checkpoint(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0]
    engine = Engine.load(gguf_path, device="cpu")
    torch.testing.assert_close(engine.logits(PROMPT), expected, rtol=1e-4, atol=1e-4)
    assert engine.generate([PROMPT], 16) == Engine.load(path, device="cpu").generate([PROMPT], 16)


def test_bf16_gguf_equals_bf16_safetensors(tiny_model_dir, tmp_path, monkeypatch):
    """Bit for bit: both engines compute each projection with ATen's F.linear (the CPU path chooser
    times its candidates on each shape's first calls, so two engines could round differently)."""
    from vramshard.layers import cpu_swiglu

    monkeypatch.setenv("VRAMSHARD_CPU_LINEAR", "linear")
    monkeypatch.setattr(cpu_swiglu, "ENABLED", False)
    path = tiny_model_dir("llama", torch.bfloat16)
    write_gguf(tmp_path / "m.gguf", open_checkpoint(path))
    a = Engine.load(tmp_path / "m.gguf", device="cpu").logits(PROMPT)
    b = Engine.load(path, device="cpu").logits(PROMPT)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
