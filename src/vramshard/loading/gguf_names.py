"""How GGUF (llama.cpp's convention) and Hugging Face name the same model.

Three mappings, each in both directions:

- architecture: HF ``model_type`` ↔ GGUF ``general.architecture`` (Mistral and Mixtral are
  ``llama`` in GGUF, Mixtral recognised by ``llama.expert_count > 0``);
- tensor names: ``model.layers.3.self_attn.q_proj.weight`` ↔ ``blk.3.attn_q.weight``; the
  experts of one MoE layer are one 3-D GGUF tensor ``blk.N.ffn_gate_exps.weight``
  ``[n_expert, n_ff, n_embd]`` (torch order; GGUF lists dims reversed); a shared expert
  (Qwen2-MoE) is ``ffn_{gate,up,down}_shexp`` and its one-row gate ``ffn_gate_inp_shexp``;
- hyper-parameters: config.json keys ↔ ``{arch}.embedding_length`` etc. Config values GGUF has
  no key for (the HF class name, Llama 3 rope parameters, sliding_window) travel in the
  vramshard-only key :data:`HF_EXTRAS_KEY` as JSON; llama.cpp ignores it.

llama.cpp stores attn_q/attn_k of Llama-family models with the rows of each head permuted
(:func:`permute_qk`, from ``LlamaModel.permute`` in llama.cpp's convert_hf_to_gguf.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass

import torch

from ..config import RopeArgs
from ..errors import ModelLoadError, UnsupportedArchitectureError
from ..layers.moe import MIXTRAL_EXPERTS, QWEN_EXPERTS, ExpertNames

log = logging.getLogger(__name__)

HF_EXTRAS_KEY = "vramshard.hf_config"  # JSON object of config.json keys GGUF has no key for
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3 rope scaling)
# config.json keys carried verbatim in HF_EXTRAS_KEY (when present in the source config).
_EXTRA_KEYS = ("architectures", "model_type", "sliding_window", "rope_parameters", "bos_token_id", "eos_token_id",
               "pad_token_id", "decoder_sparse_step", "mlp_only_layers", "hidden_act")


@dataclass(frozen=True)
class ArchSpec:
    """One supported architecture, in both namings."""

    model_type: str  # HF config.json model_type
    hf_class: str  # HF architectures[0]
    gguf_arch: str  # GGUF general.architecture
    permute_qk: bool  # llama.cpp permutes attn_q/attn_k rows for this family
    experts: ExpertNames | None = None


ARCHS: dict[str, ArchSpec] = {s.model_type: s for s in (
    ArchSpec("llama", "LlamaForCausalLM", "llama", True),
    ArchSpec("mistral", "MistralForCausalLM", "llama", True),
    ArchSpec("mixtral", "MixtralForCausalLM", "llama", True, MIXTRAL_EXPERTS),
    ArchSpec("qwen2", "Qwen2ForCausalLM", "qwen2", False),
    ArchSpec("qwen3", "Qwen3ForCausalLM", "qwen3", False),
    ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", False, QWEN_EXPERTS),
    ArchSpec("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe", False, QWEN_EXPERTS),
    ArchSpec("olmoe", "OlmoeForCausalLM", "olmoe", False, QWEN_EXPERTS),
)}
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "olmoe")


def spec_for_config(config: dict) -> ArchSpec:
    """The architecture of an HF config dict (by architectures[0], else model_type)."""
    by_class = {s.hf_class: s for s in ARCHS.values()}
    for name in config.get("architectures") or []:
        if name in by_class:
            return by_class[name]
    if config.get("model_type") in ARCHS:
        return ARCHS[config["model_type"]]
    shown = ", ".join(config.get("architectures") or []) or f"model_type {config.get('model_type')!r}"
    raise UnsupportedArchitectureError(
        f"cannot write {shown} as GGUF; supported: {', '.join(s.hf_class for s in ARCHS.values())}"
    )


def spec_for_gguf(arch: str, expert_count: int, extras: dict) -> ArchSpec:
    """The architecture of a GGUF file from its metadata."""
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)} "
            f"(HF: {', '.join(s.hf_class for s in ARCHS.values())})"
        )
    written_as = ARCHS.get(extras.get("model_type", ""))
    if written_as is not None and written_as.gguf_arch == arch:
        return written_as
    if arch == "llama":
        return ARCHS["mixtral"] if expert_count > 0 else ARCHS["llama"]
    return next(s for s in ARCHS.values() if s.gguf_arch == arch)


# ---------------------------------------------------------------- tensor names

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_INV = {v: k for k, v in _GLOBAL.items()}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_EXPERT_KINDS = ("gate", "up", "down")
# A shared expert's tensors (llama.cpp's ``*_shexp``), by GGUF name and by the HF projection kind.
_SHARED = {f"ffn_{part}_shexp": part for part in _EXPERT_KINDS}
SHARED_GATE = "ffn_gate_inp_shexp"
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.([a-z_]+)(?:\.(\d+))?\.(weight|bias)")


def hf_to_gguf(name: str, experts: ExpertNames | None) -> tuple[str, int | None] | None:
    """GGUF name of an HF tensor, and the expert index if it goes into a merged expert tensor.

    None for a tensor GGUF has no place for.
    """
    if name.endswith(".weight") and name[: -len(".weight")] in _GLOBAL_INV:
        return f"{_GLOBAL_INV[name[: -len('.weight')]]}.weight", None
    match = _HF_LAYER.fullmatch(name)
    if not match:
        return None
    layer, inner, kind = match.groups()
    if inner in _LAYER_INV:
        return f"blk.{layer}.{_LAYER_INV[inner]}.{kind}", None
    if experts is None:
        return None
    if inner == f"{experts.block}.gate" and kind == "weight":
        return f"blk.{layer}.ffn_gate_inp.weight", None
    if inner == f"{experts.block}.{experts.shared_gate}" and kind == "weight":
        return f"blk.{layer}.{SHARED_GATE}.weight", None
    for gguf_inner, part in _SHARED.items():
        if inner == f"{experts.block}.{experts.shared}.{getattr(experts, part)}" and kind == "weight":
            return f"blk.{layer}.{gguf_inner}.weight", None
    prefix = f"{experts.block}.experts."
    if inner.startswith(prefix) and kind == "weight":
        index, _, proj = inner[len(prefix):].partition(".")
        for part in _EXPERT_KINDS:
            if proj == getattr(experts, part) and index.isdigit():
                return f"blk.{layer}.ffn_{part}_exps.weight", int(index)
    return None


def gguf_to_hf(name: str, experts: ExpertNames | None, n_experts: int) -> list[str] | None:
    """HF names of a GGUF tensor: one name, or one per expert for a merged ``*_exps`` tensor.

    Also accepts the older per-expert layout ``blk.N.ffn_gate.E.weight``. None if unknown.
    """
    if name.endswith(".weight") and name[: -len(".weight")] in _GLOBAL:
        return [f"{_GLOBAL[name[: -len('.weight')]]}.weight"]
    match = _GGUF_LAYER.fullmatch(name)
    if not match:
        return None
    layer, inner, expert, kind = match.groups()
    base = f"model.layers.{layer}"
    if expert is None and inner in _LAYER:
        return [f"{base}.{_LAYER[inner]}.{kind}"]
    if experts is None or kind != "weight":
        return None
    if inner == "ffn_gate_inp" and expert is None:
        return [f"{base}.{experts.block}.gate.weight"]
    if inner == SHARED_GATE and expert is None:
        return [f"{base}.{experts.block}.{experts.shared_gate}.weight"]
    if inner in _SHARED and expert is None:
        return [f"{base}.{experts.block}.{experts.shared}.{getattr(experts, _SHARED[inner])}.weight"]
    part = inner.removeprefix("ffn_").removesuffix("_exps")
    if part not in _EXPERT_KINDS:
        return None
    proj = getattr(experts, part)
    if expert is not None and not inner.endswith("_exps"):
        return [f"{base}.{experts.block}.experts.{expert}.{proj}.weight"]
    if expert is None and inner.endswith("_exps"):
        return [f"{base}.{experts.block}.experts.{e}.{proj}.weight" for e in range(n_experts)]
    return None


def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF → llama.cpp row order of a q/k projection (weight ``[n_head*d, in]`` or bias ``[n_head*d]``).

    Within each head, HF keeps the rotary halves apart (rows ``0..d/2`` then ``d/2..d``);
    llama.cpp interleaves them (row pairs). Same as ``LlamaModel.permute``.
    """
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`permute_qk` (llama.cpp → HF row order)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


# ---------------------------------------------------------------- hyper-parameters

def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def config_to_metadata(config: dict, spec: ArchSpec) -> dict[str, object]:
    """GGUF key → value (int, float, bool or str) for an HF config. Floats are float32 in GGUF."""
    a = spec.gguf_arch
    try:
        heads = int(config["num_attention_heads"])
        dim = head_dim(config)
        meta: dict[str, object] = {
            f"{a}.vocab_size": int(config["vocab_size"]),
            f"{a}.context_length": int(config.get("max_position_embeddings", 4096)),
            f"{a}.embedding_length": int(config["hidden_size"]),
            f"{a}.block_count": int(config["num_hidden_layers"]),
            f"{a}.feed_forward_length": int(config.get("intermediate_size", 4 * int(config["hidden_size"]))),
            f"{a}.attention.head_count": heads,
            f"{a}.attention.head_count_kv": int(config.get("num_key_value_heads") or heads),
            f"{a}.attention.key_length": dim,
            f"{a}.attention.value_length": dim,
            f"{a}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
            f"{a}.rope.dimension_count": dim,
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config lacks or has a bad value for {exc}; cannot write GGUF") from None
    rope = RopeArgs.from_config(config)
    meta[f"{a}.rope.freq_base"] = rope.theta
    if rope.type == "linear":
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = rope.factor
    if spec.experts is not None:
        meta[f"{a}.expert_count"] = int(config.get("num_experts") or config["num_local_experts"])
        meta[f"{a}.expert_used_count"] = int(config["num_experts_per_tok"])
    if spec.model_type in ("qwen3_moe", "qwen2_moe"):
        meta[f"{a}.expert_feed_forward_length"] = int(config["moe_intermediate_size"])
        meta[f"{a}.expert_weights_norm"] = bool(config.get("norm_topk_prob", False))
    if spec.model_type == "qwen2_moe" and config.get("shared_expert_intermediate_size"):
        meta[f"{a}.expert_shared_feed_forward_length"] = int(config["shared_expert_intermediate_size"])
    if spec.model_type == "olmoe":  # experts of feed_forward_length, as llama.cpp reads them
        meta[f"{a}.expert_weights_norm"] = bool(config.get("norm_topk_prob", False))
    if config.get("clip_qkv") is not None:
        meta[f"{a}.attention.clamp_kqv"] = float(config["clip_qkv"])
    return meta


def config_extras(config: dict) -> str:
    """The JSON stored under :data:`HF_EXTRAS_KEY`."""
    extras = {k: config[k] for k in _EXTRA_KEYS if config.get(k) is not None}
    if "rope_parameters" not in extras:  # older config.json: rope_theta + rope_scaling
        extras["rope_parameters"] = {**(config.get("rope_scaling") or {"rope_type": "default"}),
                                     "rope_theta": RopeArgs.from_config(config).theta}
    return json.dumps(extras, sort_keys=True)


def metadata_to_config(meta: dict, spec: ArchSpec, extras: dict, tensor_names: set[str],
                       rope_freqs: torch.Tensor | None) -> dict:
    """Rebuild a config.json dict from GGUF metadata and the (HF) tensor names present."""
    a = spec.gguf_arch

    def get(key: str, default=None, required: bool = False):
        value = meta.get(f"{a}.{key}", default)
        if value is None and required:
            raise ModelLoadError(f"GGUF metadata lacks the required key '{a}.{key}'")
        return value

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; ours are uniform
        kv_heads = kv_heads[0]
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or None
    dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    theta = _f32(get("rope.freq_base", 10000.0))
    config: dict = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": dim,
        "vocab_size": int(vocab) if vocab else None,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in tensor_names,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensor_names,
    }
    if get("rope.scaling.type") == "linear":
        config["rope_parameters"] = {"rope_type": "linear", "rope_theta": theta,
                                     "factor": _f32(get("rope.scaling.factor", 1.0))}
    elif rope_freqs is not None and "rope_parameters" not in extras:
        config["rope_parameters"] = llama3_params_from_factors(
            rope_freqs, theta, dim, int(get("rope.scaling.original_context_length") or 8192))
    for key, meta_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                          ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if meta.get(meta_key) is not None:
            config[key] = int(meta[meta_key])
    if spec.experts is not None:
        n_experts = int(get("expert_count", required=True))
        config["num_local_experts"] = n_experts
        config["num_experts_per_tok"] = int(get("expert_used_count", required=True))
    if spec.model_type in ("qwen3_moe", "qwen2_moe"):
        config["num_experts"] = n_experts
        config["moe_intermediate_size"] = int(get("expert_feed_forward_length", required=True))
        # llama.cpp always renormalises qwen3moe's top-k weights and never qwen2moe's: the defaults here.
        config["norm_topk_prob"] = bool(get("expert_weights_norm", spec.model_type == "qwen3_moe"))
        dense = sorted(int(n.split(".")[2]) for n in tensor_names if n.endswith(".mlp.gate_proj.weight"))
        config["mlp_only_layers"] = dense
    if spec.model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length") or 0)
        config["qkv_bias"] = config["attention_bias"]
    if spec.model_type == "olmoe":
        config["num_experts"] = n_experts
        config["norm_topk_prob"] = bool(get("expert_weights_norm", False))  # llama.cpp never renormalises
    if get("attention.clamp_kqv") is not None:
        config["clip_qkv"] = _f32(get("attention.clamp_kqv"))
    config.update(extras)
    config["rope_theta"] = float(config["rope_parameters"].get("rope_theta", theta))
    return config


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(f"{float(value):.7g}")


# ---------------------------------------------------------------- Llama 3 rope scaling

def llama3_rope_factors(params: dict, theta: float, dim: int) -> torch.Tensor:
    """llama.cpp's ``rope_freqs`` for Llama 3 scaling: per-frequency divisors ``[dim/2]`` float32."""
    factor = float(params.get("factor", 8.0))
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_ctx = float(params.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def llama3_params_from_factors(factors: torch.Tensor, theta: float, dim: int, old_ctx: int) -> dict:
    """Recover Llama 3 rope parameters from a foreign file's ``rope_freqs`` (best effort).

    The factors fix only the two wavelength bounds old_ctx/low and old_ctx/high, so old_ctx is
    taken as given and low/high fitted from the smoothly interpolated frequencies.
    """
    values = factors.double()
    factor = float(values.max())
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": _f32(factor), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": old_ctx}
    if factor <= 1.0 + 1e-6:
        return {"rope_type": "default", "rope_theta": theta}
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    y = old_ctx * freqs / (2 * math.pi)  # old_ctx / wavelen: unscaled above `high`, fully scaled below `low`
    ones, fulls = values <= 1 + 1e-6, values >= factor * (1 - 1e-6)
    middle = ~ones & ~fulls
    smooth = (1 / values[middle] - 1 / factor) / (1 - 1 / factor)  # = (y - low) / (high - low)
    above = float(y[ones].min()) if ones.any() else float(y.max()) * 2
    below = float(y[fulls].max()) if fulls.any() else float(y.min()) / 2
    if int(middle.sum()) >= 2:
        slope, intercept = _line_fit(y[middle], smooth)
        low, high = -intercept / slope, (1 - intercept) / slope
    elif int(middle.sum()) == 1:  # one point on the ramp: put `high` between it and the unscaled
        y_mid, s = float(y[middle][0]), float(smooth[0])
        high = math.sqrt(above * y_mid)
        low = (y_mid - s * high) / (1 - s)
    else:  # a step: any bounds between the last unscaled and the first scaled frequency
        low, high = below * (above / below) ** (1 / 3), below * (above / below) ** (2 / 3)
    params.update(low_freq_factor=_f32(low), high_freq_factor=_f32(high))
    rebuilt = llama3_rope_factors(params, theta, dim)
    if not torch.allclose(rebuilt.double(), values, rtol=1e-3):
        log.warning("rope_freqs of this GGUF is not Llama 3 scaling as vramshard knows it; "
                    "using the closest llama3 parameters %s", params)
    return params


def _line_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    xm, ym = x.mean(), y.mean()
    slope = float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())
    return slope, float(ym - slope * xm)
