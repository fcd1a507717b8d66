"""The public API: load a model, get logits, generate text.

    from vramshard import Engine
    engine = Engine.load("path/to/model", vram="4GiB")
    logits = engine.logits([1, 2, 3])                     # [3, vocab] float32
    out = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .config import parse_dtype
from .errors import InvalidInputError
from .layers.step import Step
from .loading.checkpoint import Checkpoint, open_checkpoint
from .models import Model, build_model
from .plan.memory import LOGIT_ROWS, max_resident_layers, sublayer_triples, vram_need
from .plan.placement import Placement, named_placement
from .plan.planner import Planner, machine_profile
from .plan.tiers import Tiers
from .runtime.executor import Executor
from .runtime.host_weights import pack_model
from .runtime.kv_cache import KVCache
from .runtime.sampler import Sampler, SamplingParams
from .runtime.weights import load_weights
from .units import parse_size

log = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    """Timing of the last ``generate``/``stream`` call."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes out of the prefill step.
        decoded = max(self.generated_tokens - 1, 0)
        return decoded / self.decode_s if self.decode_s else 0.0


class Engine:
    """A loaded model ready to run: weights placed, tokenizer attached."""

    def __init__(self, model: Model, executor: Executor, tokenizer=None, name: str = "model",
                 max_context: int | None = None, vram_budget: int | None = None, max_step_tokens: int = 2048):
        self.model = model
        self.args = model.args
        self.executor = executor
        self.tokenizer = tokenizer
        self.model_name = name
        self.max_context = max_context or model.args.max_position_embeddings
        self.vram_budget = vram_budget
        self.max_step_tokens = max_step_tokens
        self.plan = None  # the planner's PlanSet when the placement was planned
        self.last_stats = GenerationStats()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, vram: str | int | None = None, device: str | None = None,
             dtype: str | torch.dtype | None = None, placement: str | Placement | None = None,
             max_context: int | None = None, progress: Callable[[int, int], None] | None = None,
             **options) -> "Engine":
        """Load a Hugging Face model directory or a ``.gguf`` file.

        vram: the VRAM budget (``"4GiB"``, bytes, or None for no limit).
        device: ``"cpu"`` or ``"cuda"``; default: cuda when available.
        dtype: weights and compute dtype; default: the checkpoint's.
        placement: a named placement (``cpu``, ``gpu``, ``layers:N``, ``layers:max``, ``stream``,
            ``static``) or a :class:`Placement`; default: chosen from the budget.
        max_context: longest sequence (prompt + answer) to allow; default: the model's (capped
            at 8192 on the GPU, where its KV cache is reserved in VRAM).
        options: ``max_batch`` (sequences whose KV is reserved, default 1), ``max_step_tokens``
            (largest step, default 2048), ``threads`` (CPU threads), ``num_slots`` (stream ring),
            ``tiers`` (:class:`Tiers`), ``profile`` (a machine profile for the planner).
        """
        checkpoint = open_checkpoint(path)
        return cls.from_checkpoint(checkpoint, vram=vram, device=device, dtype=dtype, placement=placement,
                                   max_context=max_context, progress=progress, **options)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, vram=None, device=None, dtype=None, placement=None,
                        max_context=None, progress=None, **options) -> "Engine":
        """Build an engine from an opened (or in-memory) :class:`Checkpoint`; see :meth:`load`."""
        model = build_model(checkpoint.config, parse_dtype(dtype))
        weights = load_weights(model, checkpoint, progress)
        tokenizer = _load_tokenizer(checkpoint)
        return cls.from_weights(model, weights, tokenizer, name=checkpoint.path.name, vram=vram, device=device,
                                placement=placement, max_context=max_context, **options)

    @classmethod
    def from_weights(cls, model: Model, weights: dict[str, torch.Tensor], tokenizer=None, name: str = "model",
                     vram=None, device=None, placement=None, max_context=None, max_batch: int = 1,
                     max_step_tokens: int = 2048, threads: int | None = None, num_slots: int = 2,
                     tiers: Tiers | None = None, profile=None) -> "Engine":
        """Build an engine from a model and its CPU weights (consumed), e.g. random weights of a real shape.

        With a VRAM budget and no explicit placement, the planner chooses the pinned set and a
        placement per token tier from the machine profile (``profile``: a
        :class:`~vramshard.profile.Profile`, default this machine's).
        """
        limit = model.args.max_position_embeddings
        if max_context is not None and max_context > limit:
            raise InvalidInputError(f"max_context {max_context} exceeds the model's limit of {limit} positions")
        device = _resolve_device(device)
        budget = None if vram in (None, "none") else parse_size(vram)
        context = max_context or (limit if device == "cpu" else min(limit, DEFAULT_GPU_CONTEXT))
        kv_tokens = max(1, max_batch) * context
        plan_set = None
        if placement is None and device != "cpu" and budget is not None:
            tiers = tiers or Tiers(tuple(t for t in Tiers().sizes if t <= max_step_tokens) or (max_step_tokens,))
            plan_set = Planner(model, profile or machine_profile(), budget, context=kv_tokens, tiers=tiers,
                               num_slots=num_slots, name=name).plan()
            placement = plan_set.tiered()
        else:
            placement = choose_placement(model, placement, device, budget, kv_tokens, max_step_tokens)
        host = pack_model(list(model), weights, pin=placement.uses_gpu)
        executor = Executor(model, host, placement, budget=budget, max_tokens=max_step_tokens,
                            max_context=kv_tokens, kv_slots=1, num_slots=num_slots, threads=threads,
                            device=device if device != "cpu" else "cuda")
        log.info("%s", executor.describe())
        engine = cls(model, executor, tokenizer, name=name, max_context=context, vram_budget=budget,
                     max_step_tokens=max_step_tokens)
        engine.plan = plan_set
        return engine

    # ------------------------------------------------------------------ inference
    def logits(self, ids: Sequence[int] | torch.Tensor, pixel_values: torch.Tensor | None = None,
               image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [len(ids), vocab] of one sequence, all positions, in one pass.

        Vision-language models: ``pixel_values`` / ``image_grid_thw`` as the Hugging Face image
        processor makes them, with ``ids`` holding the expanded image placeholder tokens.
        """
        if pixel_values is not None:
            from . import vlm
            return vlm.logits(self, ids, pixel_values, image_grid_thw)
        ids = self._check_prompt(ids)
        kv = self.executor.new_kv_cache(slots=1, max_ctx=len(ids))
        rows = []
        # On the GPU, the workspace holds logits for at most LOGIT_ROWS rows per step.
        chunk_size = min(self.max_step_tokens, LOGIT_ROWS) if self.executor.uses_gpu else self.max_step_tokens
        for begin in range(0, len(ids), chunk_size):
            chunk = ids[begin : begin + chunk_size]
            step = Step.single(begin, len(chunk), all_logits=True, kv_lookup=kv)
            rows.append(self.executor.forward(torch.tensor(chunk), step))
        return torch.cat(rows)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None, pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | None = None) -> list[list[int]]:
        """Generate for several prompts at once (batched); returns the new tokens of each.

        Greedy when temperature is 0. A sequence ends at an EOS token (included in its
        output), at a stop string (output cut before it; needs a tokenizer) or after
        ``max_new_tokens``. With ``seed``, prompt i samples with seed ``seed + i``.
        With ``pixel_values`` / ``image_grid_thw`` (see :meth:`logits`), the images of all
        prompts in placeholder order.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidInputError("prompts must be a list of token-id lists")
        params = [SamplingParams(temperature, top_k, top_p, None if seed is None else seed + i)
                  for i in range(len(prompts))]
        if pixel_values is not None:
            from . import vlm
            return vlm.generate(self, prompts, pixel_values, image_grid_thw, max_new_tokens, params, stop)
        outputs = [[] for _ in prompts]
        for index, token in self._run(prompts, max_new_tokens, params, stop):
            outputs[index].append(token)
        if stop:
            outputs = [self._cut_at_stop(out, stop) for out in outputs]
        return outputs

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Iterator[int]:
        """Yield the new token ids of one prompt as they are generated."""
        params = [SamplingParams(temperature, top_k, top_p, seed)]
        for _, token in self._run([prompt_ids], max_new_tokens, params, None):
            yield token

    def scheduler(self, max_seqs: int = 8, max_context: int | None = None, max_step_tokens: int | None = None,
                  chunk_sizes: Sequence[int] | None = None, kv_tokens: int | None = None):
        """A continuous-batching :class:`~vramshard.runtime.scheduler.Scheduler` over this engine's
        executor, with a KV pool of ``max_seqs`` sequences of ``max_context`` tokens (default: the
        engine's context) allocated now; see the Scheduler for the other arguments."""
        from .runtime.scheduler import Scheduler

        return Scheduler(self.executor, max_seqs=max_seqs, max_context=max_context or self.max_context,
                         max_step_tokens=max_step_tokens or self.max_step_tokens, chunk_sizes=chunk_sizes,
                         kv_tokens=kv_tokens, eos_ids=self._eos_ids(), tokenizer=self.tokenizer,
                         vocab_size=self.args.vocab_size)

    # ------------------------------------------------------------------ internals
    def _run(self, prompts, max_new_tokens: int, params: list[SamplingParams], stop) -> Iterator[tuple[int, int]]:
        if not prompts:
            return
        if max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if stop and self.tokenizer is None:
            raise InvalidInputError("stop strings need a tokenizer, and this model has none")
        prompts = [self._check_prompt(p) for p in prompts]
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.max_context:
            raise InvalidInputError(
                f"prompt plus max_new_tokens is {longest} tokens, more than the context of {self.max_context}"
            )
        if max_new_tokens == 0:
            return
        samplers = [Sampler(p) for p in params]
        eos = self._eos_ids()
        stats = self.last_stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
        kv = self.executor.new_kv_cache(slots=len(prompts), max_ctx=longest)
        t0 = time.perf_counter()
        logits = self._prefill(prompts, kv, stats)
        stats.prefill_s = time.perf_counter() - t0
        active = list(range(len(prompts)))
        cached = [len(p) for p in prompts]
        generated = [[] for _ in prompts]
        t0 = time.perf_counter()
        while True:
            next_tokens = {}
            for row, seq in enumerate(active):
                token = samplers[seq](logits[row])
                generated[seq].append(token)
                stats.generated_tokens += 1
                yield seq, token
                if not (token in eos or len(generated[seq]) >= max_new_tokens
                        or (stop and self._cut_at_stop(generated[seq], stop) != generated[seq])):
                    next_tokens[seq] = token
            active = list(next_tokens)
            if not active:
                break
            rows = []
            group_size = min(self.max_step_tokens, LOGIT_ROWS)
            for begin in range(0, len(active), group_size):
                group = active[begin : begin + group_size]
                step = Step(group, [cached[s] for s in group], [1] * len(group), list(range(len(group))),
                            kv_lookup=kv)
                rows.append(self.executor.forward(torch.tensor([next_tokens[s] for s in group]), step))
                stats.steps += 1
            logits = torch.cat(rows)
            for s in active:
                cached[s] += 1
        stats.decode_s = time.perf_counter() - t0

    def _prefill(self, prompts: list[list[int]], kv: KVCache, stats: GenerationStats) -> torch.Tensor:
        """Run all prompts through the model in steps of at most ``max_step_tokens`` tokens.

        Returns the logits [len(prompts), V] of each prompt's last token.
        """
        last = [None] * len(prompts)
        done = [0] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            slots, starts, lengths, rows, finishing = [], [], [], [], []
            room = self.max_step_tokens
            for seq, prompt in enumerate(prompts):
                if room == 0 or len(finishing) == LOGIT_ROWS:
                    break
                if done[seq] == len(prompt):
                    continue
                n = min(len(prompt) - done[seq], room)
                slots.append(seq), starts.append(done[seq]), lengths.append(n)
                room -= n
                if done[seq] + n == len(prompt):
                    rows.append(sum(lengths) - 1)
                    finishing.append(seq)
            ids = [t for seq, s, n in zip(slots, starts, lengths) for t in prompts[seq][s : s + n]]
            step = Step(slots, starts, lengths, rows, kv_lookup=kv)
            logits = self.executor.forward(torch.tensor(ids), step)
            stats.steps += 1
            for row, seq in enumerate(finishing):
                last[seq] = logits[row]
            for seq, n in zip(slots, lengths):
                done[seq] += n
        return torch.stack(last)

    def _check_prompt(self, ids) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        if isinstance(ids, (str, bytes)):
            raise InvalidInputError("token ids expected, got a string; encode it with engine.tokenizer first")
        ids = list(ids)
        if not ids:
            raise InvalidInputError("a prompt needs at least one token")
        vocab = self.args.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidInputError(f"token id {t!r} is out of range for a vocabulary of {vocab}")
        if len(ids) > self.max_context:
            raise InvalidInputError(f"prompt has {len(ids)} tokens, more than the context of {self.max_context}")
        return ids

    def _eos_ids(self) -> set[int]:
        ids = set(self.args.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def _cut_at_stop(self, tokens: list[int], stop: Sequence[str]) -> list[int]:
        """The longest prefix of tokens whose text contains no stop string."""
        text = self.tokenizer.decode(tokens)
        if not any(s in text for s in stop):
            return tokens
        for n in range(len(tokens)):
            if any(s in self.tokenizer.decode(tokens[: n + 1]) for s in stop):
                return tokens[:n]
        return tokens


DEFAULT_GPU_CONTEXT = 8192  # KV reserved by default on the GPU when the model allows more


def _resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidInputError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' asked for, but no CUDA GPU is available")
    return device


def choose_placement(model: Model, placement: str | Placement | None, device: str, budget: int | None,
                     kv_tokens: int, max_step_tokens: int) -> Placement:
    """The placement to run: the one asked for, else all-CPU without a GPU, else the
    whole model resident when it fits, else as many whole layers as fit."""
    triples = sublayer_triples(model)
    layers = model.args.num_hidden_layers
    if isinstance(placement, Placement):
        return placement
    if device == "cpu":
        if placement not in (None, "cpu"):
            raise InvalidInputError(f"placement {placement!r} needs a GPU, but the device is the CPU")
        return named_placement("cpu", triples, layers)
    if placement is not None:
        most = None
        if budget is not None and str(placement).strip().lower() == "layers:max":
            most = max_resident_layers(model, budget, 1, kv_tokens, max_step_tokens)
        return named_placement(placement, triples, layers, most)
    everything = named_placement("gpu", triples, layers)
    if budget is None or vram_need(model, everything, 1, kv_tokens, max_step_tokens).total <= budget:
        return everything
    return named_placement("layers:max", triples, layers,
                           max_resident_layers(model, budget, 1, kv_tokens, max_step_tokens))


def _load_tokenizer(checkpoint: Checkpoint):
    try:
        from .loading.tokenizer import Tokenizer
    except ImportError:  # pragma: no cover - tokenizer module always ships
        return None
    if checkpoint.tokenizer_dir is not None:
        return Tokenizer.from_dir(checkpoint.tokenizer_dir)
    if checkpoint.tokenizer_spec:
        return Tokenizer.from_gguf_spec(checkpoint.tokenizer_spec)
    return None
