"""The public API: load a model, get logits, generate text.

    from vramshard import Engine
    engine = Engine.load("path/to/model", vram="4GiB")
    logits = engine.logits([1, 2, 3])                     # [3, vocab] float32
    out = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from . import budget_follower
from .budget_follower import BudgetFollower
from .config import parse_dtype
from .errors import BudgetError, InvalidInputError
from .host_memory import check_available
from .layers import cpu_linear
from .layers.step import Step
from .loading.checkpoint import Checkpoint, open_checkpoint
from .models import Model, build_model
from .plan import calibrate
from .plan.memory import (LOGIT_ROWS, max_resident_layers, moe_layers, sublayer_packed_bytes, sublayer_triples,
                          vram_need)
from .plan.placement import Placement, TieredPlacement, named_placement
from .plan.planner import Planner, machine_profile, named_plan
from .plan.tiers import Tiers
from .profile import drift
from .runtime import budget as budgets
from .runtime import wire_codec
from .runtime.executor import Executor
from .runtime.host_allowance import available_host_bytes
from .runtime.host_weights import PackedWeights, pack_model, splits_ffns
from .runtime.kv_cache import DEFAULT_BLOCK_SIZE
from .runtime.plan_check import CpuCheck, DecodeCheck
from .runtime.request import Request
from .runtime.sampler import SamplingParams
from .runtime.timeline import Timeline
from .runtime.weights import load_weights
from .units import auto_vram_budget, format_bytes, is_auto, parse_size

log = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    """Timing of the last ``generate``/``stream`` call.

    prefill_s: from the call until every prompt has its first new token (prompts are read then);
    decode_s: from there to the end. ``extra`` holds ``ttft_s`` (first token of the first prompt),
    ``forward_s`` (time inside the executor) and ``scheduling_s`` (the rest of the steps' time:
    scheduling, sampling, streaming in Python).
    """

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


def _link_codec(model: Model) -> bool | None:
    """Whether an engine of ``model`` streams its fills coded: None (the switch, VRAMSHARD_WIRE_CODEC) where the host
    can hold the coded copies of every sub-layer a plan may stream beside the pinned weights, else False (its
    plans then price raw fills, as its executor will make them), with a warning."""
    if wire_codec.wire_ratio(model.dtype) == 1:
        return None
    streamable = sum(sublayer_packed_bytes(model, s.name) for s in model if s.kind in ("attn", "ffn"))
    weights = sum(sublayer_packed_bytes(model, s.name) for s in model)
    available = available_host_bytes()
    if wire_codec.holds_coded_copies(streamable, weights, available):
        return None
    log.warning("not coding stream fills for the link (VRAMSHARD_WIRE_CODEC): the coded copies of the streamable "
                "weights (%s) would take over %d%% of the %s of host memory left beside the pinned weights; plans "
                "price raw fills", format_bytes(wire_codec.coded_bytes(streamable)),
                round(100 * wire_codec.HOST_SHARE), format_bytes(max(0, available - weights)))
    return False


class Engine:
    """A loaded model ready to run: weights placed, tokenizer attached."""

    def __init__(self, model: Model, executor: Executor, tokenizer=None, name: str = "model",
                 max_context: int | None = None, vram_budget: int | None = None, max_step_tokens: int = 2048,
                 kv_tokens: int | None = None):
        self.model = model
        self.args = model.args
        self.executor = executor
        self.tokenizer = tokenizer
        self.model_name = name
        self.max_context = max_context or model.args.max_position_embeddings
        self.vram_budget = vram_budget
        self.max_step_tokens = max_step_tokens
        # KV positions reserved at load (on the GPU, the paged pools of all sequences must fit in them).
        self.kv_tokens = kv_tokens or self.max_context
        self.plan = None  # the planner's PlanSet when the placement was planned
        # Wall seconds of loading by phase ("read weights", "plan", "host layout", "CPU parts", "CPU kernels",
        # "VRAM"; set by the loaders).
        self.load_seconds: dict[str, float] = {}
        self.overlap: bool | None = None  # schedulers' default (None: VRAMSHARD_OVERLAP, see the scheduler)
        self.vision = None  # vlm.VisionSetup of a vision-language model (set by vlm.configure)
        self.last_stats = GenerationStats()
        # The budget while running: polled at step boundaries (see set_vram / poll_budget).
        self.device = "cuda" if executor.uses_gpu or executor.simulated else "cpu"
        self.budget = BudgetFollower(self, vram_budget)
        self._decode_check: DecodeCheck | None = None  # decode steps vs the plan in force
        self._cpu_check: CpuCheck | None = None  # the CPU work of each tier's steps, for the plan in force
        self._trials_seen = self._trials()  # trials before the last step measured
        executor.oom_handler = self.budget.recover_from_oom

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, vram: str | int | None = None, device: str | None = None,
             dtype: str | torch.dtype | None = None, placement: str | Placement | None = None,
             max_context: int | None = None, progress: Callable[[int, int], None] | None = None,
             **options) -> "Engine":
        """Load a Hugging Face model directory or a ``.gguf`` file.

        vram: the VRAM budget (``"4GiB"``, bytes, ``"auto"`` for the free VRAM less a safety margin
            (no GPU at all on a machine without CUDA), or None for no limit).
        device: ``"cpu"`` or ``"cuda"``; default: cuda when available.
        dtype: weights and compute dtype; default: the checkpoint's.
        placement: a named placement (``cpu``, ``gpu``, ``layers:N``, ``layers:max``, ``stream``,
            ``static``) or a :class:`Placement`; default: chosen from the budget.
        max_context: longest sequence (prompt + answer) to allow; default: the model's (capped
            at 8192 on the GPU, where its KV cache is reserved in VRAM).
        options: ``max_batch`` (sequences whose KV is reserved, default 1), ``kv_tokens`` (KV
            positions to reserve, shared by all sequences; default ``max_batch`` x context), ``max_step_tokens``
            (largest step, default 2048), ``threads`` (the most CPU threads the engine computes on,
            e.g. to leave cores to a game beside it; the planner prices CPU work at that many; default all
            cores), ``num_slots`` (stream ring),
            ``tiers`` (:class:`Tiers`), ``profile`` (a machine profile for the planner),
            ``vision`` (:class:`vramshard.vlm.VisionOptions`, vision-language models only),
            ``decode_graphs`` (replay decode steps over VRAM-resident sub-layers from CUDA graphs; default
            on, used only on CUDA), ``decode_compile`` (a ``torch.compile`` backend such as "inductor"
            for the graphs' fusable parts; default off), ``overlap`` (queue each greedy GPU decode
            step before the one before it is read; default on, ``VRAMSHARD_OVERLAP=off`` or False
            turns it off).
        """
        vision = options.pop("vision", None)
        checkpoint = open_checkpoint(path)
        engine = cls.from_checkpoint(checkpoint, vram=vram, device=device, dtype=dtype, placement=placement,
                                     max_context=max_context, progress=progress, **options)
        if any(s.kind == "vision" for s in engine.model):
            from . import vlm
            from .loading.image import ImageConfig

            image_config = ImageConfig.from_dir(checkpoint.path) if checkpoint.path.is_dir() else ImageConfig()
            vlm.configure(engine, vision, image_config, options.get("profile"))
        return engine

    def chat(self, messages, images=(), **sampling) -> list[int]:
        """Answer OpenAI-style chat messages whose parts may hold images (PIL, paths, data URLs);
        returns the new token ids. Needs a tokenizer with a chat template."""
        from . import vlm

        return vlm.generate_chat(self, messages, images, **sampling)

    def stream_chat(self, messages, images=(), **sampling) -> Iterator[int]:
        """As :meth:`chat`, yielding token ids as they are generated."""
        from . import vlm

        return vlm.stream_chat(self, messages, images, **sampling)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, vram=None, device=None, dtype=None, placement=None,
                        max_context=None, progress=None, **options) -> "Engine":
        """Build an engine from an opened (or in-memory) :class:`Checkpoint`; see :meth:`load`."""
        model = build_model(checkpoint.config, parse_dtype(dtype))
        check_available(host_bytes_to_load(model), f"{checkpoint.path.name}'s weights")
        reading = Timeline()
        with reading.phase("read weights"):
            weights = load_weights(model, checkpoint, progress)
            tokenizer = _load_tokenizer(checkpoint)
        return cls.from_weights(model, weights, tokenizer, name=checkpoint.path.name, vram=vram, device=device,
                                placement=placement, max_context=max_context, timeline=reading, **options)

    @classmethod
    def from_weights(cls, model: Model, weights: dict[str, torch.Tensor], tokenizer=None, name: str = "model",
                     **options) -> "Engine":
        """Build an engine from a model and its CPU weights (consumed), e.g. random weights of a real shape.

        With a VRAM budget and no explicit placement, the planner chooses the pinned set and a
        placement per token tier from the machine profile (``profile``: a
        :class:`~vramshard.profile.Profile`, default this machine's). ``options``: as
        :meth:`from_host`.
        """
        return cls._build(model, lambda pin, split: pack_model(list(model), weights, pin=pin, splittable=split),
                          tokenizer, name, can_split=True, **options)

    @classmethod
    def from_host(cls, model: Model, host: dict[str, PackedWeights], tokenizer=None, name: str = "model",
                  **options) -> "Engine":
        """Build an engine over weights already packed by :func:`~vramshard.runtime.host_weights.pack_model`
        (pinned, to stream at full speed), e.g. several engines of different placements sharing one
        host copy. ``options``: ``vram``, ``device``, ``placement``, ``max_context``, ``max_batch``,
        ``kv_tokens``, ``max_step_tokens``, ``threads``, ``num_slots``, ``tiers``, ``profile``
        (see :meth:`load`)."""
        return cls._build(model, lambda pin, split: host, tokenizer, name, can_split=splits_ffns(list(model), host),
                          **options)

    @classmethod
    def _build(cls, model: Model, pack: Callable[[bool, bool], dict[str, PackedWeights]], tokenizer, name: str,
               can_split: bool, vram=None, device=None, placement=None, max_context=None, max_batch: int = 1,
               max_step_tokens: int = 2048, threads: int | None = None, num_slots: int = 2,
               tiers: Tiers | None = None, profile=None, kv_tokens: int | None = None,
               simulate_gpu: bool = False, decode_graphs: bool = True,
               decode_compile: str | None = None, overlap: bool | None = None,
               timeline: Timeline | None = None) -> "Engine":
        timeline = timeline or Timeline()  # (from_checkpoint's, with its reading already in it)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InvalidInputError(f"threads must be a whole number of CPU threads >= 1, got {threads!r}")
        limit = model.args.max_position_embeddings
        if max_context is not None and max_context > limit:
            raise InvalidInputError(f"max_context {max_context} exceeds the model's limit of {limit} positions")
        if simulate_gpu:  # plan and account as on a GPU, compute on the CPU (tests, demonstrations)
            device, budget = "cpu", (None if vram in (None, "none") else parse_size(vram))
        else:
            budget, device = resolve_budget(vram, device)
        gpu_side = device != "cpu" or simulate_gpu
        context = max_context or (limit if not gpu_side else min(limit, DEFAULT_GPU_CONTEXT))
        kv_tokens = kv_tokens or max(1, max_batch) * context
        tiers = tiers or Tiers(tuple(t for t in Tiers().sizes if t <= max_step_tokens) or (max_step_tokens,))
        plan_set = settings = None
        link_codec = _link_codec(model) if gpu_side else None
        if gpu_side:
            profile = planning_profile(profile, model.dtype).limited_to(threads)
            settings = budgets.PlanSettings(profile, tiers, kv_tokens, num_slots, name, wire_codec=link_codec,
                                            decode_graphs=decode_graphs and device != "cpu" and not simulate_gpu)
        with timeline.phase("plan"):
            if placement is None and gpu_side and budget is not None:
                with settings.pricing():
                    plan_set = Planner(model, settings.profile, budget, context=kv_tokens, tiers=tiers,
                                       num_slots=num_slots, name=name, split_ffns=can_split).plan()
                placement = plan_set.tiered()
            else:
                placement = choose_placement(model, placement, "cuda" if simulate_gpu else device, budget,
                                             kv_tokens, max_step_tokens)
                if settings is not None and isinstance(placement, Placement):  # packed where the profile says
                    placement = named_plan(model, placement, settings.profile, tiers)
        # Pinned whenever a GPU is in use: a budget that grows later streams from it at full speed.
        # Dense FFNs are laid out in pieces only when the plan splits them: the layout transposes
        # down_proj, which the CPU reads more slowly in half precision (measured on a 2-core box).
        with timeline.phase("host layout"):
            host = pack(device != "cpu", _splits_ffns(placement))
        if settings is not None:  # later plans (a changed budget) may split only what the packing allows
            settings = dataclasses.replace(settings, split_ffns=splits_ffns(list(model), host))
        executor = Executor(model, host, placement, budget=budget, max_tokens=max_step_tokens,
                            max_context=kv_tokens, kv_slots=1, num_slots=num_slots, threads=threads,
                            device=device if device != "cpu" else "cuda", simulate_gpu=simulate_gpu,
                            decode_graphs=decode_graphs and device != "cpu" and not simulate_gpu,
                            decode_compile=decode_compile, wire_codec_on=link_codec)
        timeline.merge(executor.setup)
        log.info("%s", executor.describe())
        log.info("loaded %s in %s", name, timeline.describe())
        engine = cls(model, executor, tokenizer, name=name, max_context=context, vram_budget=budget,
                     max_step_tokens=max_step_tokens, kv_tokens=kv_tokens)
        engine.plan = plan_set
        engine.load_seconds = dict(timeline.seconds)
        engine.overlap = overlap
        engine.budget.settings = settings
        engine.device = "cuda" if simulate_gpu else device
        if is_auto(vram) and device != "cpu":
            engine.budget.watcher.set_source(budgets.AutoBudget(device))
            engine.budget.watcher.accept(budget)
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
            self.poll_budget()
            chunk = ids[begin : begin + chunk_size]
            step = Step.single(begin, len(chunk), all_logits=True, kv_lookup=kv)
            rows.append(self.executor.forward(torch.tensor(chunk), step))
        return torch.cat(rows)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None, pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | None = None, **adjust) -> list[list[int]]:
        """Generate for several prompts at once (continuous batching); returns the new tokens of each.

        Greedy when temperature is 0. A sequence ends at an EOS token (included in its
        output), at a stop string (output cut before it; needs a tokenizer) or after
        ``max_new_tokens``. With ``seed``, prompt i samples with seed ``seed + i``.
        With ``pixel_values`` / ``image_grid_thw`` (see :meth:`logits`), the images of all
        prompts in placeholder order. ``adjust``: ``min_p``, ``presence_penalty``, ``frequency_penalty``,
        ``repetition_penalty``, ``repeat_last_n``, ``logit_bias`` (see :class:`~vramshard.runtime.sampler.SamplingParams`).
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidInputError("prompts must be a list of token-id lists")
        params = [SamplingParams(temperature, top_k, top_p, None if seed is None else seed + i, **adjust)
                  for i in range(len(prompts))]
        if pixel_values is not None:
            from . import vlm
            return vlm.generate(self, prompts, pixel_values, image_grid_thw, max_new_tokens, params, stop)
        requests: list[Request] = []
        for _ in self._run(prompts, max_new_tokens, params, stop, requests):
            pass
        return [list(r.output_ids) for r in requests] if requests else [[] for _ in prompts]

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, scheduler=None,
               **adjust) -> Iterator[int]:
        """Yield the new token ids of one prompt as they are generated (``adjust``: as :meth:`generate`).

        ``scheduler``: one of this engine's (:meth:`scheduler`) to run in, kept by the caller between
        calls: its KV pool and prefix cache then serve the next prompt (a chat's next turn reads only
        what its history does not share with the last one). Default: a scheduler of its own."""
        params = [SamplingParams(temperature, top_k, top_p, seed, **adjust)]
        for _, token in self._run([prompt_ids], max_new_tokens, params, None, scheduler=scheduler):
            yield token

    def step_shape(self) -> tuple[int, tuple[int, ...] | None]:
        """(most tokens in one step, prompt chunk sizes): the planner's token tiers when the
        engine was planned (steps then fill whole tiers), else ``max_step_tokens`` and no tiers."""
        if self.plan is not None and self.plan.tiers:
            sizes = tuple(sorted(self.plan.tiers))
            fitting = tuple(size for size in sizes if size <= self.max_step_tokens) or sizes[:1]
            return fitting[-1], fitting
        return self.max_step_tokens, None

    def scheduler(self, max_seqs: int = 8, max_context: int | None = None, max_step_tokens: int | None = None,
                  chunk_sizes: Sequence[int] | None = None, kv_tokens: int | None = None, ignore_eos: bool = False,
                  overlap: bool | None = None, prefix_cache: bool | None = None):
        """A continuous-batching :class:`~vramshard.runtime.scheduler.Scheduler` over this engine's
        executor, with a paged KV pool of ``kv_tokens`` positions (default ``max_seqs`` x
        ``max_context``, on the GPU at most what was reserved at load) allocated now, shared by
        up to ``max_seqs`` sequences of at most ``max_context`` tokens (default: the engine's
        context). Step size and chunk sizes default to :meth:`step_shape`. ``ignore_eos``: generate
        ``max_new_tokens`` whatever comes (benchmarks). ``overlap``: queue a greedy GPU step's
        successor before reading it (None: ``VRAMSHARD_OVERLAP``; see the scheduler's docstring).
        ``prefix_cache``: reuse the KV blocks of prompt prefixes read before (None:
        ``VRAMSHARD_PREFIX_CACHE``, on by default)."""
        from .runtime.scheduler import Scheduler

        max_context = max_context or self.max_context
        step_tokens, tiers = self.step_shape()
        if max_step_tokens is None and chunk_sizes is None:
            max_step_tokens, chunk_sizes = step_tokens, tiers
        if kv_tokens is None:
            kv_tokens = max_seqs * max_context
            if self.executor.uses_gpu:
                kv_tokens = min(kv_tokens, self.kv_tokens)
        return Scheduler(self.executor, max_seqs=max_seqs, max_context=max_context,
                         max_step_tokens=max_step_tokens or self.max_step_tokens, chunk_sizes=chunk_sizes,
                         kv_tokens=kv_tokens, eos_ids=() if ignore_eos else self._eos_ids(), tokenizer=self.tokenizer,
                         vocab_size=self.args.vocab_size,
                         max_logit_rows=LOGIT_ROWS if self.executor.uses_gpu else None,
                         before_step=self.poll_budget,
                         after_step=self._measured,
                         overlap=self.overlap if overlap is None else overlap, prefix_cache=prefix_cache)

    def _trials(self) -> tuple[int, int]:
        """(CPU projections' path trials, steps the run-ahead worker ran with a team on trial) so far."""
        return cpu_linear.trial_calls(), self.executor.team_trial_steps

    def _measured(self, stats) -> None:
        """A step's measurements, against the plan in force (the scheduler calls this after each)."""
        plans = self.executor.plans
        tier = plans.tiers[plans.index_for(stats.tokens)]
        self.budget.recent_tiers.append(tier)
        trials = self._trials()
        if trials != self._trials_seen:
            # CPU projections chose their paths in the step, trying slower ones, or the worker tried a
            # team it may not keep: not the plan's speed.
            self._trials_seen = trials
            return
        self.plan_check().add(stats.tokens, stats.sequences, stats.forward_s, stats.context)
        background = self.budget.background
        if background.busy or stats.end_time - stats.seconds < background.finished_at:
            return  # the background planner's Python held the GIL during the step: not a fair sample
        self.cpu_check().add(tier, stats.host_compute_s, stats.host_split_s, stats.context)

    def cpu_check(self) -> CpuCheck:
        """The host's time in each tier's CPU work, in the steps of the plan in force."""
        if self._cpu_check is None or self._cpu_check.plan is not self.plan:
            to_planned = self._cpu_context_scale(self.plan) if self.plan is not None else None
            self._cpu_check = CpuCheck(self.plan, self.budget.cpu_judged, to_planned)
        return self._cpu_check

    def restart_cpu_check(self) -> None:
        """Time each tier's CPU work afresh (the load beside the engine changed: :mod:`~vramshard.budget_follower`)."""
        self._cpu_check = None

    def cpu_stats(self) -> dict:
        """The CPU side as the engine runs it (the server's ``/v1/stats``): the most threads it computes
        on (None: all cores), whether its one-token steps' CPU work is still to be fitted, the tiers
        whose CPU work was fitted (or found as priced), the run-ahead worker's tuned teams, the cores busy
        beside the engine at the last reading, the cores that work wants (more than it got where it shared
        them with the engine's threads: :func:`~vramshard.runtime.host_load.wanted_beside`) and the lasting
        changes of that load (each judged the CPU work again)."""
        shift = self.budget.load_shift
        return {"threads": self.executor.threads, "calibration_pending": self.calibration_pending(),
                "calibrated_tiers": sorted(self.budget.cpu_judged),
                "worker_teams": {str(tokens): team for tokens, team in self.executor.worker_teams().items()},
                "other_cores_busy": None if shift is None or shift.latest_got is None else round(shift.latest_got, 2),
                "other_cores_wanted": None if shift is None or shift.latest is None else round(shift.latest, 2),
                "load_changes": list(self.budget.load_changes)}

    def calibration_pending(self, tokens: int = 1) -> bool:
        """Whether the plan in force computes on the CPU in steps of ``tokens`` tokens and the engine
        has not yet judged that tier's CPU work against the profile (the in-situ fit of
        :mod:`~vramshard.budget_follower`, once per tier, from its steps after the first that ran no
        trials): until then its plan may change once the fit is made."""
        if self.plan is None:
            return False
        plans = self.executor.plans
        tier = plans.tiers[plans.index_for(tokens)]
        return tier in self.plan.tiers and calibrate.has_cpu_work(self.plan, tier) \
            and tier not in self.budget.cpu_judged

    def cpu_steps_to_judge(self, tokens: int = 1) -> int:
        """Steps of ``tokens`` tokens the plan in force has still to run before the engine judges the CPU
        work of their tier (:meth:`calibration_pending`; 0: judged, or nothing to judge)."""
        if not self.calibration_pending(tokens):
            return 0
        plans = self.executor.plans
        return self.cpu_check().steps_to_judge(plans.tiers[plans.index_for(tokens)])

    def plan_check(self) -> DecodeCheck:
        """Single-sequence decode steps of the plan in force against its prediction (a warning is
        logged once when they are 1.5x off: the machine profile does not fit the machine)."""
        plan = self.plan
        if self._decode_check is None or self._decode_check.plan is not plan:
            tier = min(plan.tiers) if plan is not None else 1
            predicted = plan.tiers[tier].predicted_s if plan is not None and tier == 1 else None
            to_planned = None
            if predicted is not None:
                settings = self.budget.plan_settings()
                with settings.pricing():
                    to_planned = calibrate.by_context(self.model, settings.profile, plan, tier)
            self._decode_check = DecodeCheck(self.executor.plans.name, predicted, tier, plan, to_planned)
        return self._decode_check

    def _cpu_context_scale(self, plan):
        """(tier, context) -> :func:`~vramshard.plan.calibrate.by_context` of the plan's tier's CPU work
        other than split FFN parts (each tier's made when its first step is kept; 1 where it cannot say)."""
        profile, scales = self.budget.plan_settings().profile, {}

        def to_planned(tier: int, context: int) -> float:
            if tier not in scales:
                scales[tier] = calibrate.by_context(self.model, profile, plan, tier, cpu_rest=True)
            return scales[tier](context) if scales[tier] is not None else 1.0

        return to_planned

    # ------------------------------------------------------------------ the VRAM budget while running
    def set_vram(self, vram: str | int | None) -> None:
        """Change the VRAM budget; it takes effect at the next step boundary (any thread may call it).

        vram: bytes, a size (``"4GiB"``), ``"auto"`` (follow the free VRAM less a margin) or None /
        ``"none"`` (no limit). A smaller budget re-plans and gives VRAM back (unpinned sub-layers,
        smaller slots and expert cache, KV caches moved to host memory if they no longer fit) before
        the next step runs; a larger one pins more again. Requests in flight go on, KV content kept.
        See :mod:`vramshard.budget_follower`.
        """
        self.budget.set_vram(vram)

    def poll_budget(self):
        """Adapt to the budget source if it changed (the scheduler calls this before each step).
        Returns the executor's :class:`~vramshard.runtime.executor.ReconfigureReport`, or None."""
        return self.budget.poll()

    def budget_state(self) -> dict:
        """The budget in force and the VRAM in use, for ``GET /v1/budget`` and logs."""
        return self.budget.state()

    @property
    def budget_watcher(self) -> budgets.BudgetWatcher:
        return self.budget.watcher

    @property
    def budget_events(self) -> collections.deque[dict]:
        """Adaptations to budget changes, newest last (``why``: the source, "refine" for the full
        plan after a quick one, "out of memory")."""
        return self.budget.events

    def _run(self, prompts, max_new_tokens: int, params: list[SamplingParams], stop,
             requests: list[Request] | None = None, multimodal: Sequence | None = None, scheduler=None,
             extra: dict | None = None) -> Iterator[tuple[int, int]]:
        """Run ``prompts`` through a scheduler of their own; yield (prompt index, token) as steps
        make them. ``requests`` (if given) receives the :class:`Request` objects. ``multimodal``:
        per prompt, its :class:`~vramshard.runtime.request.MultimodalInput` or None; ``scheduler``:
        one made earlier (its KV pool allocated before a vision phase); ``extra``: merged into the
        statistics' ``extra``."""
        if not prompts:
            return
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        if stop and self.tokenizer is None:
            raise InvalidInputError("stop strings need a tokenizer, and this model has none")
        prompts = [self._check_prompt(p) for p in prompts]
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.max_context:
            raise InvalidInputError(
                f"prompt plus max_new_tokens is {longest} tokens, more than the context of {self.max_context}"
            )
        stats = self.last_stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
        stats.extra.update(extra or {})
        if max_new_tokens == 0:
            return
        kept = scheduler is not None
        scheduler = scheduler or self._scheduler_for(prompts, max_new_tokens)
        before = _counters(scheduler)
        news: list[tuple[int, int]] = []
        mine = [] if requests is None else requests
        multimodal = multimodal or [None] * len(prompts)
        for index, (prompt, sampling, mm) in enumerate(zip(prompts, params, multimodal)):
            def deliver(output, index=index):
                news.extend((index, token) for token in output.token_ids)
            mine.append(scheduler.add(prompt, sampling, max_new_tokens, stop, on_output=deliver, multimodal=mm))
        start = time.perf_counter()
        try:
            while scheduler.has_work:
                scheduler.step()
                yield from news
                news.clear()
        except GeneratorExit:
            if kept:  # closed early (Ctrl-C): the caller's scheduler retires what is left before its next use
                for request in mine:
                    request.cancel()
                while scheduler.has_work:
                    scheduler.step()
            raise
        finally:
            _fill_stats(stats, scheduler, mine, start, before)

    def _scheduler_for(self, prompts: list[list[int]], max_new_tokens: int):
        """A scheduler whose paged KV pool holds all ``prompts`` at once (on the GPU, at most the
        KV reserved at load: then later prompts wait for blocks of finished ones)."""
        needs = [len(p) + max_new_tokens for p in prompts]
        pool = sum(-(-n // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE for n in needs)
        max_seqs = len(prompts)
        if self.executor.uses_gpu:
            pool = max(min(pool, self.kv_tokens), max(needs))
            max_seqs = min(max_seqs, LOGIT_ROWS)
        return self.scheduler(max_seqs=max_seqs, max_context=max(needs), kv_tokens=pool)

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


def resolve_budget(vram: str | int | None, device: str | None) -> tuple[int | None, str]:
    """(budget bytes or None, device) from ``vram`` and ``device`` as :meth:`Engine.load` takes them.

    ``vram="auto"``: the free VRAM less a safety margin; on a machine without CUDA (or with
    ``device="cpu"``) it means no GPU, so the device becomes the CPU.
    """
    if is_auto(vram):
        if device is None and not torch.cuda.is_available():
            return None, "cpu"
        device = _resolve_device(device)
        if device == "cpu":
            return None, device
        budget = auto_vram_budget(device)
        if budget is None or budget <= 0:
            raise BudgetError(f"--vram auto found no free VRAM on {device} beyond the safety margin; "
                              "free some VRAM, give a size such as --vram 2GiB, or run on the CPU (--device cpu)")
        log.info("--vram auto: budget %s", format_bytes(budget))
        return budget, device
    device = _resolve_device(device)
    return (None if vram in (None, "none") else parse_size(vram)), device


def _resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidInputError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' asked for, but no CUDA GPU is available")
    return device


def _splits_ffns(placement: Placement | TieredPlacement) -> bool:
    placements = placement.placements if isinstance(placement, TieredPlacement) else (placement,)
    return any(p.split_names() for p in placements)


def host_bytes_to_load(model: Model) -> int:
    """Host memory that loading ``model`` takes at its peak: its weights are read, then packed into
    their pinned host copy one sub-layer at a time (each source dropped once packed), so the model
    and its largest sub-layer."""
    return model.nbytes + max(s.nbytes for s in model)


def planning_profile(profile, dtype):
    """The profile an engine plans with: ``profile`` (default: this machine's), its CPU side scaled to
    the host's memory read and CPU products now (:mod:`vramshard.profile.drift`; with
    ``VRAMSHARD_COPY_DRIFT=on`` its copies beside CPU work too), with the factors earlier engines fitted
    on it for ``dtype`` (:func:`vramshard.plan.calibrate.with_learned`)."""
    profile = drift.copies_corrected(drift.corrected(profile or machine_profile(), dtype))
    _say_if_timed_without_gemv(profile)
    if budget_follower.CALIBRATE:  # what an earlier engine measured on the same profile
        profile = calibrate.with_learned(profile, dtype)
    return profile


_told_without_gemv: set[str] = set()  # profiles already named in the log


def _say_if_timed_without_gemv(profile) -> None:
    """Say once per profile when the C kernel computes one-row CPU products here but the profile timed
    them through torch's paths: on the H100 machine the kernel read those weights 1.5-2.5x faster, so
    plans put too little on the CPU until the engine has fitted its CPU factors to its own steps."""
    from .layers import cpu_gemv

    if profile.data.get("synthetic") or profile.cpu_gemv or not cpu_gemv.computes(1):
        return
    key = profile.data.get("created", "") + profile.data.get("fingerprint_hash", "")
    if key not in _told_without_gemv:
        _told_without_gemv.add(key)
        log.warning("the machine profile timed one-token CPU products through torch, and the C kernel now computes "
                    "them (faster): plans put too little on the CPU until the engine has fitted its steps; run "
                    "`vramshard profile` again for a profile timed through it")


def choose_placement(model: Model, placement: str | Placement | TieredPlacement | None, device: str,
                     budget: int | None, kv_tokens: int, max_step_tokens: int) -> Placement | TieredPlacement:
    """The placement to run: the one asked for (a name, a placement, or one per token tier),
    else all-CPU without a GPU, else the whole model resident when it fits, else as many
    whole layers as fit."""
    triples = sublayer_triples(model)
    layers = model.args.num_hidden_layers
    if isinstance(placement, (Placement, TieredPlacement)):
        return placement
    if device == "cpu":
        if placement not in (None, "cpu"):
            raise InvalidInputError(f"placement {placement!r} needs a GPU, but the device is the CPU")
        return named_placement("cpu", triples, layers)
    if placement is not None:
        most = None
        if budget is not None and str(placement).strip().lower() == "layers:max":
            most = max_resident_layers(model, budget, 1, kv_tokens, max_step_tokens)
        return named_placement(placement, triples, layers, most, moe_layers=moe_layers(model))
    everything = named_placement("gpu", triples, layers)
    if budget is None or vram_need(model, everything, 1, kv_tokens, max_step_tokens).total <= budget:
        return everything
    return named_placement("layers:max", triples, layers,
                           max_resident_layers(model, budget, 1, kv_tokens, max_step_tokens))


def _counters(scheduler) -> tuple[int, int, float, float]:
    """A scheduler's running totals: generated tokens, steps, forward and step seconds."""
    return (scheduler.total_generated_tokens, scheduler.total_steps, scheduler.total_forward_s,
            scheduler.total_step_s)


def _fill_stats(stats: GenerationStats, scheduler, requests: list[Request], start: float,
                before: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)) -> None:
    """Timings of one ``_run`` from its scheduler's counters (less ``before``, their values when it
    began: a kept scheduler ran earlier calls too) and the requests' timestamps."""
    end = time.perf_counter()
    firsts = [r.first_token_s for r in requests if r.first_token_s is not None]
    prefill_end = max(firsts) if len(firsts) == len(requests) and firsts else end
    stats.prefill_s = prefill_end - start
    stats.decode_s = end - prefill_end
    generated, steps, forward_s, step_s = (now - then for now, then in zip(_counters(scheduler), before))
    stats.generated_tokens = generated
    stats.steps = steps
    stats.extra.update(
        ttft_s=(min(firsts) - start) if firsts else None,
        forward_s=forward_s,
        scheduling_s=step_s - forward_s,
        max_running=max((s.running for s in scheduler.history), default=0),
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in requests),
    )


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
