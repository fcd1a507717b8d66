"""Every architecture against Hugging Face transformers (float32, CPU)."""

import pytest
import torch
import transformers

from tiny_models import ARCHS
from vramshard import Engine

PROMPT = [5, 17, 42, 3, 77, 12, 9, 60, 31, 2, 88, 14]


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float(), model


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    expected, _ = hf_logits(path, PROMPT)
    engine = Engine.load(path, device="cpu")
    got = engine.logits(PROMPT)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decode_equals_full_pass(arch, tiny_model_dir):
    """Prefill 5 tokens, then feed the rest one by one through the KV cache."""
    from vramshard.layers.step import Step

    engine = Engine.load(tiny_model_dir(arch), device="cpu")
    full = engine.logits(PROMPT)
    kv = engine.executor.new_kv_cache(slots=1, max_ctx=len(PROMPT))
    rows = [engine.executor.forward(torch.tensor(PROMPT[:5]), Step.single(0, 5, all_logits=True, kv_lookup=kv))]
    # A chunk of 3, then single tokens: exercises the chunked-prefill mask too.
    rows.append(engine.executor.forward(torch.tensor(PROMPT[5:8]), Step.single(5, 3, all_logits=True, kv_lookup=kv)))
    for pos in range(8, len(PROMPT)):
        rows.append(engine.executor.forward(torch.tensor([PROMPT[pos]]), Step.single(pos, 1, kv_lookup=kv)))
    torch.testing.assert_close(torch.cat(rows), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    _, model = hf_logits(path, PROMPT)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    expected = out[0, len(PROMPT):].tolist()
    engine = Engine.load(path, device="cpu")
    assert engine.generate([PROMPT], max_new_tokens=32) == [expected]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mistral"])
def test_batched_generation_equals_single(arch, tiny_model_dir):
    engine = Engine.load(tiny_model_dir(arch), device="cpu")
    prompts = [PROMPT, PROMPT[:3], [7], PROMPT[4:11]]
    batched = engine.generate(prompts, max_new_tokens=20)
    single = [engine.generate([p], max_new_tokens=20)[0] for p in prompts]
    assert batched == single


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint(dtype, tiny_model_dir):
    path = tiny_model_dir("qwen3", dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0]
    # The float32 reference over the same (rounded) weights.
    ref = Engine.load(path, device="cpu", dtype="float32").logits(PROMPT)
    torch.testing.assert_close(ref, expected, rtol=1e-4, atol=1e-4)
    # Computing in the checkpoint dtype stays within what the dtype allows.
    got = Engine.load(path, device="cpu").logits(PROMPT)
    assert Engine.load(path, device="cpu").model.dtype == dtype
    tol = 0.05 if dtype == torch.bfloat16 else 0.01
    assert (got - expected).abs().max() < tol * expected.abs().max() + tol
