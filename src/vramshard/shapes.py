"""Real model shapes with random weights, built in memory (no downloads).

Speed does not depend on weight values, so benchmarks run the real shapes of
Mistral-NeMo-Minitron-8B, Llama-3.1-8B, Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B and OLMoE-1B-7B with random
weights.
"""

from __future__ import annotations

import torch

from .errors import InvalidInputError
from .models import Model, build_model

_DENSE_ROPE = {"rope_theta": 1000000.0}

SHAPES: dict[str, dict] = {
    # Mistral-NeMo-Minitron-8B (fp16): explicit head_dim 128.
    "nemo-8b": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                    intermediate_size=11520, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=131072, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, dtype="float16", **_DENSE_ROPE),
    # Llama-3.1-8B (bf16) with its rope scaling.
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, dtype="bfloat16",
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      rope_theta=500000.0),
    # Qwen3-30B-A3B (bf16): 128 experts, 8 routed, expert FFN 768.
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, dtype="bfloat16", **_DENSE_ROPE),
    # Qwen1.5-MoE-A2.7B (bf16): 60 experts, 4 routed, expert FFN 1408, a gated shared expert of 5632.
    "qwen1.5-moe-a2.7b": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=2048,
                              intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=[], num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                              vocab_size=151936, max_position_embeddings=8192, rms_norm_eps=1e-6,
                              tie_word_embeddings=False, dtype="bfloat16", **_DENSE_ROPE),
    # OLMoE-1B-7B (bf16): 64 experts of 1024, 8 routed; q/k norms over the whole projections.
    "olmoe-1b-7b": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", hidden_size=2048,
                        intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, clip_qkv=None,
                        tie_word_embeddings=False, dtype="bfloat16"),
    # Tiny shapes for tests and quick CPU runs (seconds, not minutes).
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, dtype="float32", rope_theta=10000.0),
    "tiny-qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                           intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                           max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           dtype="float32", **_DENSE_ROPE),
}


def shape_config(name: str) -> dict:
    """config.json dict of a named real shape."""
    try:
        return dict(SHAPES[name])
    except KeyError:
        raise InvalidInputError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}") from None


def shape_model(name: str, dtype: torch.dtype | None = None) -> Model:
    return build_model(shape_config(name), dtype)


def random_weights(model: Model, seed: int = 0, device: str | None = None) -> dict[str, torch.Tensor]:
    """Random CPU weights for every tensor of ``model`` (std 0.02; norms 1).

    Generated on the GPU when there is one (fast), else on the CPU, where large tensors
    repeat a random block (values do not matter for speed; routers stay fully random).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    block = None
    weights = {}
    for name, spec in model.weight_specs().items():
        if len(spec.shape) == 1:
            weights[name] = torch.ones(spec.shape, dtype=spec.dtype)
            continue
        numel = spec.nbytes // spec.dtype.itemsize
        if device == "cpu" and numel > 2**22 and ".gate." not in name:
            if block is None:
                block = torch.randn(2**22, generator=generator) * 0.02
            reps = -(-numel // block.numel())
            flat = block.to(spec.dtype).repeat(reps)[:numel]
            weights[name] = flat.view(spec.shape)
        else:
            t = torch.randn(spec.shape, generator=generator, device=device, dtype=torch.float32) * 0.02
            weights[name] = t.to(spec.dtype).cpu()
    return weights


# Qwen2.5-VL-7B (bf16; Cosmos-Reason1-7B has the same shape): vision encoder of 32 blocks (width 1280,
# 16 heads, windows of 112 pixels, full attention in blocks 7, 15, 23, 31) and a Qwen2 language model.
SHAPES["qwen2.5-vl-7b"] = dict(
    architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6, tie_word_embeddings=False,
    dtype="bfloat16", rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu",
                       tokens_per_second=2),
)
