"""Tiny random Hugging Face models of every supported architecture, made with transformers.

Shared by the tests: ``make_tiny(name, tmp_path)`` saves one with ``save_pretrained``
and returns its directory. Shapes are small but keep the features that matter:
GQA / MQA / odd head counts, explicit head_dim, qkv bias, q/k norm, llama3 rope
scaling, tied and untied embeddings, MoE routing, a shared expert.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _configs():
    import transformers as tf

    return {
        # GQA 6 query heads / 2 kv heads, llama3 rope scaling, untied.
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
            num_attention_heads=6, num_key_value_heads=2, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, rope_theta=500000.0)),
        # MQA (one kv head), tied embeddings.
        "llama_mqa_tied": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
        # Explicit head_dim (as Mistral-NeMo / Minitron): 3 heads x 32 != hidden 48.
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(
            num_attention_heads=3, num_key_value_heads=1, head_dim=32, sliding_window=None)),
        # qkv bias, odd head count (3 heads, MHA).
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(
            num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=True)),
        # q/k norm, head_dim 16 with 4 heads (64 != hidden 48).
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
        # qkv bias, a gated shared expert beside 6 routed ones, top-k weights not renormalised.
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
            num_attention_heads=3, num_key_value_heads=1, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[])),
        # q/k norm over the whole projections, a clamp of q, k, v, GQA, experts of intermediate_size.
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, dict(
            num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
            intermediate_size=24, norm_topk_prob=False, clip_qkv=2.0)),
    }


ARCHS = ("llama", "llama_mqa_tied", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe")


def make_hf_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    config_cls, model_cls, extra = _configs()[name]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init is tiny (std 0.02); scale weights up so logits vary and greedy paths differ.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2 if "embed" in pname or "lm_head" in pname else 0.08)
            elif "norm" in pname:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    return model.to(dtype)


def make_tiny(name: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    model = make_hf_model(name, seed, dtype)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory
