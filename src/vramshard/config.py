"""Model hyper-parameters read from a Hugging Face ``config.json`` dict.

Field names mirror ``config.json``; unknown keys are ignored. Each architecture
file (``models/<arch>.py``) turns a config dict into :class:`ModelArgs` through
:meth:`ModelArgs.from_config` plus its own small overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .errors import ModelLoadError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "f32": torch.float32, "f16": torch.float16, "half": torch.float16, "float": torch.float32}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16``; None stays None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower().removeprefix("torch.")]
    except KeyError:
        from .errors import InvalidInputError

        raise InvalidInputError(
            f"unknown dtype {value!r}; use one of float32, float16, bfloat16"
        ) from None


@dataclass(frozen=True)
class RopeArgs:
    """Rotary position embedding: base frequency and optional scaling (default, linear, llama3)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    SUPPORTED = ("default", "linear", "llama3")

    @classmethod
    def from_config(cls, config: dict) -> "RopeArgs":
        # transformers >= 5 writes "rope_parameters" (theta inside); older files "rope_theta" + "rope_scaling".
        params = dict(config.get("rope_scaling") or {})
        params.update(config.get("rope_parameters") or {})
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in cls.SUPPORTED:
            raise ModelLoadError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(cls.SUPPORTED)}"
            )
        return cls(
            theta=float(theta),
            type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class MoEArgs:
    """Routed experts of a Mixture-of-Experts FFN."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    sparse_step: int = 1  # every sparse_step-th layer is MoE (Qwen3-MoE decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (Qwen3-MoE mlp_only_layers)
    shared_intermediate_size: int = 0  # a shared expert every token goes through (Qwen2-MoE); 0: none
    shared_gated: bool = False  # the shared expert's output scaled by sigmoid(its own one-row gate)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a decoder-only transformer (the fields every architecture shares)."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeArgs = field(default_factory=RopeArgs)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k (Qwen3, OLMoE)
    qk_norm_per_head: bool = True  # over each head (Qwen3), else over the whole projection (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] after their projections (OLMoE)
    moe: MoEArgs | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32  # dtype the checkpoint was saved in

    @classmethod
    def from_config(cls, config: dict, **overrides) -> "ModelArgs":
        """Common fields from a config.json dict; ``overrides`` win over the file."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            values = dict(
                architecture=(config.get("architectures") or ["?"])[0],
                model_type=config.get("model_type", "?"),
                hidden_size=hidden,
                intermediate_size=int(config.get("intermediate_size", 4 * hidden)),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab_size=int(config["vocab_size"]),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=RopeArgs.from_config(config),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=_as_tuple(config.get("eos_token_id")),
                dtype=parse_dtype(config.get("dtype") or config.get("torch_dtype") or "float32"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks the required key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json has a value of the wrong type: {exc}") from None
        values.update(overrides)
        args = cls(**values)
        args.validate()
        return args

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.moe is not None:
            moe = self.moe
            if not 0 < moe.top_k <= moe.num_experts or moe.intermediate_size <= 0:
                raise ModelLoadError(
                    f"config.json: a MoE model routes each token to 1..num_experts experts of positive size, got "
                    f"num_experts_per_tok={moe.top_k}, num_experts={moe.num_experts}, "
                    f"expert intermediate size={moe.intermediate_size}")
            if moe.shared_intermediate_size < 0:
                raise ModelLoadError(f"config.json: shared_expert_intermediate_size must be >= 0, got "
                                     f"{moe.shared_intermediate_size}")

    def replace(self, **changes) -> "ModelArgs":
        return dataclasses.replace(self, **changes)


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
