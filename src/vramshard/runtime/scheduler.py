"""Continuous batching: one forward step at a time over every request in flight.

Requests enter a queue. Each :meth:`Scheduler.step` admits waiting requests while a sequence slot
and KV blocks are free, then fills a token budget (``max_step_tokens``): first one decode token
for every running sequence that is generating, then chunks of prompts still being read (chunked
prefill, chunks cut so the step's tokens fill a token tier). It runs the executor once (which
picks the tier's placement), samples each request that finished reading its input with the
request's own sampler, streams the new tokens and text out, and retires finished sequences,
freeing their KV blocks at once.

The KV cache is a paged pool of ``kv_tokens`` positions in fixed-size blocks
(:mod:`~vramshard.runtime.kv_cache`), allocated when the scheduler is built. A request reserves
the blocks of ``prompt + max_new_tokens`` positions when admitted (cached prefix blocks that running
requests hold are counted once for all who share them) and takes physical blocks as it grows: a new
request that does not fit waits, and a running sequence is never evicted. Sequences
of different lengths share the pool, so short ones do not hold a whole ``max_context`` row.
Cancelled requests are dropped at the next step boundary.

Prefix caching (``prefix_cache``, ``VRAMSHARD_PREFIX_CACHE``, on by default): the full KV blocks of
a prompt are filed under their token ids once computed, and a finished request's blocks (prompt
and answer) when it ends. A request admitted later whose prompt starts with the same full blocks
takes them and reads only the rest: a chat turn re-sent with its history, or prompts that share a
system prompt, skip the prefill of what was read before. A request whose next uncached blocks a
running request is still to write waits until they are written (prompts added together that share a
system prompt read it once, the first of them). Prompts with images are left out (the
same token ids may stand for other pictures). Cached blocks nobody holds give way to new ones when
the pool runs out of free blocks (the least recently released first).

Overlap: when a step's sampled tokens are all plain greedy argmaxes taken on the GPU, none is a
request's first token, and the next step only queues GPU work (no CPU sub-layer the host would
compute before it could read this step, see ``Executor.queues_without_waiting``), the next step
is queued before they are read. Its decode rows take their input tokens from the GPU copy
(:meth:`~vramshard.runtime.step_logits.TokenIds.feed`), so the host schedules, prepares and
launches step k+1 (and then streams step k's tokens out) while the GPU computes step k, instead
of the GPU waiting for the host between steps. A sequence that step k ends (EOS, a stop string)
has one more row computed in step k+1, whose result is dropped; one that ends by length is left
out of step k+1, as are cancelled ones. ``overlap=False`` (or ``VRAMSHARD_OVERLAP=off``) reads
every step before the next is scheduled.

Not thread-safe except :meth:`Scheduler.add` and :meth:`Request.cancel`, which any thread may
call; :class:`~vramshard.runtime.engine_loop.EngineLoop` runs steps on a background thread.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch

from ..env import switch
from ..errors import InvalidInputError
from ..layers.step import Step
from .kv_cache import prefix_keys
from .request import MultimodalInput, Request, RequestOutput, RequestStatus, cut_at_stop
from .sampler import SamplingParams
from .step_logits import TokenIds

log = logging.getLogger(__name__)

# VRAMSHARD_OVERLAP: "auto" (queue the next step before reading a greedy GPU step, see above) or "off".
OVERLAP = os.environ.get("VRAMSHARD_OVERLAP", "auto").lower()
if OVERLAP not in ("auto", "off"):
    raise ValueError(f"VRAMSHARD_OVERLAP must be auto or off, got {OVERLAP!r}")


@dataclass(frozen=True)
class StepStats:
    """What one step did (for metrics)."""

    tokens: int  # new tokens run through the model
    prefill_tokens: int
    decode_tokens: int
    sequences: int  # sequences in the step
    sampled: int  # tokens sampled (requests that got a new token)
    seconds: float  # wall time of the whole step (scheduling, forward, sampling, detokenizing; from the
    # end of the step before when this one was queued before that ended: its share of the wall time)
    queue_length: int  # requests waiting after admission
    running: int  # sequences holding a KV slot during the step
    end_time: float  # time.time() at the end of the step
    forward_s: float = 0.0  # of ``seconds``, from the forward's start until its samples were read
    prepare_s: float = 0.0  # of the rest, the part before the forward (budget, admission, the step's inputs)
    host_compute_s: float = 0.0  # of ``forward_s``, the host computing CPU work (StepReport.host_compute_s)
    host_wait_s: float = 0.0  # of ``forward_s``, the host blocked on GPU results that CPU work needs
    host_split_s: float = 0.0  # of ``host_compute_s``, split dense FFNs' CPU parts (StepReport.host_split_s)
    context: int = 0  # the longest context a sequence of the step attends over (its cached tokens and the new ones)

    @property
    def overhead_s(self) -> float:
        """Time of the step spent in Python outside the forward pass (scheduling, sampling, streaming)."""
        return self.seconds - self.forward_s


@dataclass
class _Chunk:
    request: Request
    length: int
    samples: bool  # the chunk ends the request's known tokens: its last row gives logits


@dataclass
class _Launched:
    """A step whose forward is queued (on a GPU it may still be running) and whose samples are not
    read yet. Logit row r is the r-th chunk that samples."""

    chunks: list[_Chunk]
    tokens: TokenIds | None  # every logit row's argmax (None: no sampler takes it)
    host_logits: torch.Tensor | None  # [k, V] float32 on the host: rows of samplers that read them
    host_rows: dict[int, int]  # logit row -> row of host_logits
    prefill: int
    decode: int
    running: int  # sequences holding a KV slot when it was launched
    prepare_start: float
    forward_start: float
    chainable: bool  # the next step may be queued before this one is read
    host_compute_s: float = 0.0  # the executor's StepReport of the forward: host computing CPU work
    host_wait_s: float = 0.0  # and blocked on the GPU results that work needed
    host_split_s: float = 0.0  # of host_compute_s, in split dense FFNs' CPU parts
    context: int = 0  # the longest context a sequence of the step attends over

    def sampled_rows(self) -> dict[Request, int]:
        """Request -> its logit row, for the requests this step samples."""
        sampling = [c.request for c in self.chunks if c.samples]
        return {request: row for row, request in enumerate(sampling)}



def _host_times(executor) -> tuple[float, float, float]:
    """(host computing, host waiting, of the computing: in split FFN parts) seconds of the
    executor's last forward (zeros if it keeps none)."""
    report = getattr(executor, "report", None)
    return (getattr(report, "host_compute_s", 0.0), getattr(report, "host_wait_s", 0.0),
            getattr(report, "host_split_s", 0.0))

class Scheduler:
    """Runs many requests through ``executor`` with continuous batching and chunked prefill.

    max_seqs: sequences running at once. max_context: longest sequence (prompt plus answer).
    max_step_tokens: new tokens per step. chunk_sizes: token tiers; a prompt that does not fit in
    what is left of a step is cut so the step's tokens fill the largest tier that they can.
    kv_tokens: positions of the paged KV pool, shared by the running sequences (default
    ``max_seqs * max_context``). eos_ids: tokens that end a sequence. tokenizer: needed for text
    output and stop strings. vocab_size: checks prompt token ids. max_logit_rows: most sequences
    sampled in one step (the GPU workspace holds that many logit rows; None: no limit).
    before_step: called at every step boundary before anything is scheduled (the engine adapts
    to a changed VRAM budget there: the executor may re-plan and move KV caches, block tables stay).
    after_step: called with each step's :class:`StepStats` (the engine checks decode steps
    against its plan's prediction). overlap: queue a greedy GPU step's successor before reading
    it (see the module docstring); None: ``VRAMSHARD_OVERLAP`` decides, for GPU steps only; True:
    for every greedy step, also on the CPU (where nothing runs meanwhile: tests of the mechanism).
    prefix_cache: reuse the KV blocks of prompt prefixes read before (see the module docstring);
    None: ``VRAMSHARD_PREFIX_CACHE`` decides (on unless set off).
    """

    def __init__(self, executor, max_seqs: int = 8, max_context: int = 4096, max_step_tokens: int = 2048,
                 chunk_sizes: Sequence[int] | None = None, kv_tokens: int | None = None,
                 eos_ids: Iterable[int] = (), tokenizer=None, vocab_size: int | None = None,
                 stats_window: int = 512, max_logit_rows: int | None = None,
                 before_step: Callable[[], object] | None = None,
                 after_step: Callable[[StepStats], object] | None = None, overlap: bool | None = None,
                 prefix_cache: bool | None = None):
        if max_seqs < 1 or max_context < 1 or max_step_tokens < 1:
            raise InvalidInputError(f"max_seqs, max_context and max_step_tokens must be >= 1, got "
                                    f"{max_seqs}, {max_context}, {max_step_tokens}")
        self.executor = executor
        self.max_seqs = max_seqs
        self.max_context = max_context
        self.max_step_tokens = max_step_tokens
        self.chunk_sizes = tuple(sorted(set(int(c) for c in chunk_sizes or ()) - {0}))
        self.kv_tokens = max_seqs * max_context if kv_tokens is None else int(kv_tokens)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_logit_rows = max_logit_rows
        self.before_step = before_step
        self.after_step = after_step
        if overlap is None:
            overlap = None if OVERLAP == "auto" else False
        self.overlap = overlap
        self.prefix_cache = switch("VRAMSHARD_PREFIX_CACHE", True) if prefix_cache is None else bool(prefix_cache)
        self._pending: _Launched | None = None  # queued, not read yet
        self._last_end = 0.0  # when the last step was read (perf_counter)
        if self.kv_tokens < 1:
            raise InvalidInputError(f"kv_tokens must be >= 1, got {self.kv_tokens}")
        self.kv = executor.new_kv_cache(slots=1, max_ctx=self.kv_tokens)
        self.blocks = self.kv.allocator
        self.free_slots: list[int] = list(range(max_seqs))
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._incoming: collections.deque[Request] = collections.deque()  # append/popleft: thread-safe
        self.history: collections.deque[StepStats] = collections.deque(maxlen=stats_window)
        self.total_steps = 0
        self.total_prompt_tokens = 0
        self.total_cached_prompt_tokens = 0  # prompt tokens taken from the prefix cache, not computed
        self.total_generated_tokens = 0
        self.total_step_s = 0.0
        self.total_forward_s = 0.0
        self.total_overlapped = 0  # steps queued before the step before them was read

    # ------------------------------------------------------------------ requests
    def add(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, max_new_tokens: int = 128,
            stop: Sequence[str] | None = None, on_output: Callable[[RequestOutput], None] | None = None,
            multimodal: MultimodalInput | None = None) -> Request:
        """Queue a prompt (any thread); returns its :class:`Request`. Raises InvalidInputError for a
        request that can never run (bad token ids, longer than a KV slot, stop strings without a tokenizer).
        ``multimodal``: rotary positions and image features of a prompt with images (vision-language models)."""
        prompt_ids = self.check_prompt(prompt_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        if stop and self.tokenizer is None:
            raise InvalidInputError("stop strings need a tokenizer, and this model has none")
        if multimodal is not None and multimodal.positions.shape[-1] != len(prompt_ids):
            raise InvalidInputError(f"multimodal positions cover {multimodal.positions.shape[-1]} tokens, "
                                    f"the prompt has {len(prompt_ids)}")
        request = Request(prompt_ids, params or SamplingParams(), max_new_tokens, stop, on_output, multimodal)
        self.check_fits(request.prompt_len, max_new_tokens)
        request.attach_tokenizer(self.tokenizer)
        self._incoming.append(request)
        return request

    def check_prompt(self, ids) -> list[int]:
        """The prompt as a list of valid token ids, or InvalidInputError saying what is wrong."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        if isinstance(ids, (str, bytes)):
            raise InvalidInputError("token ids expected, got a string; encode it with the tokenizer first")
        ids = list(ids)
        if not ids:
            raise InvalidInputError("a prompt needs at least one token")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (self.vocab_size and t >= self.vocab_size):
                raise InvalidInputError(f"token id {t!r} is out of range for a vocabulary of {self.vocab_size}")
        return ids

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """InvalidInputError unless a prompt of this length plus its answer fits one KV slot."""
        need = prompt_len + max_new_tokens
        limit = min(self.max_context, self.kv_tokens)
        if need > limit:
            raise InvalidInputError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) is {need} tokens, "
                f"more than the context of {limit}; shorten the prompt or ask for fewer tokens"
            )

    @property
    def kv_reserved(self) -> int:
        """KV positions the running requests hold or may still take (whole blocks; a prefix they share
        counted once)."""
        return self.blocks.committed_blocks * self.blocks.block_size

    @property
    def has_work(self) -> bool:
        return bool(self._incoming or self.waiting or self.running or self._pending)

    @property
    def queue_length(self) -> int:
        """Requests waiting for a KV slot."""
        return len(self.waiting) + len(self._incoming)

    # ------------------------------------------------------------------ one step
    def step(self) -> StepStats | None:
        """Admit, run one forward step, sample, stream, retire. None when there was nothing to run.

        With overlap, the step read here may have been queued by the call before, and the next one
        is queued before this one is read."""
        start = time.perf_counter()
        if self.before_step is not None:
            self.before_step()
        self._take_incoming()
        self._retire_cancelled()
        self._admit()
        current, self._pending = self._pending, None
        if current is None:
            chunks = self._schedule(None)
            if not chunks:
                return None
            current = self._launch(chunks, None, start)
        if current.chainable:
            chunks = self._schedule(current)
            if chunks and (self.overlap is True
                           or self.executor.queues_without_waiting(sum(c.length for c in chunks))):
                self._pending = self._launch(chunks, current, time.perf_counter())
                self.total_overlapped += 1
        return self._complete(current)

    def _launch(self, chunks: list[_Chunk], after: _Launched | None, prepare_start: float) -> _Launched:
        """Queue the forward of ``chunks``. ``after``: the step still unread before it, whose sampled
        tokens feed the decode rows of the requests it samples (from the GPU, unseen by the host)."""
        fed = after.sampled_rows() if after is not None else {}
        sources: list[int] = []  # per token: a row of after's tokens, or -1 (the host's ids)
        ids: list[int] = []
        slots, starts, lengths, rows, tables = [], [], [], [], []
        prefill = decode = 0
        for chunk in chunks:
            request = chunk.request
            if request in fed:  # a decode row after a sample not read yet (chunk.length is 1)
                sources.append(fed[request])
                ids.append(0)
            else:
                ids += request.next_input(chunk.length)
                sources += [-1] * chunk.length
            if request.in_prefill:
                prefill += chunk.length
            else:
                decode += chunk.length
            slots.append(request.slot), starts.append(request.num_cached), lengths.append(chunk.length)
            tables.append(self.blocks.grow(request.slot, request.num_cached + chunk.length))
            if chunk.samples:
                rows.append(len(ids) - 1)
        rope, embeds = _multimodal_inputs(chunks) if any(c.request.multimodal for c in chunks) else (None, None)
        step = Step(slots, starts, lengths, rows, kv_lookup=self.kv, block_tables=tables, rope_positions=rope,
                    input_embeds=embeds)
        running = len(self.running)
        forward_start = time.perf_counter()
        sampling = [c.request for c in chunks if c.samples]
        try:
            unread = any(source >= 0 for source in sources)
            inputs = after.tokens.feed(sources, ids) if unread else torch.tensor(ids, dtype=torch.long)
            logits = self.executor.forward_logits(inputs, step)  # [len(rows), V]
            need = [row for row, request in enumerate(sampling) if request.sampler.needs_logits]
            tokens = logits.argmax() if len(need) < len(sampling) else None
            host = logits.rows(need) if need else None
        except Exception as exc:  # a failed step must not leave requests hanging: end them with the error
            log.exception("forward step failed; ending the %d running request(s)", len(self.running))
            self._pending = None
            self.abort_running(f"the forward step failed: {exc}")
            raise
        # A step that samples some request's first token is read at once: queueing the next step
        # first (maybe a new CUDA graph to capture) would hold its time to first token back.
        firsts = any(not request.output_ids for request in sampling)
        for chunk in chunks:
            request = chunk.request
            request.num_cached += chunk.length
            if self.prefix_cache and request.multimodal is None and request.num_cached <= request.prompt_len:
                # The prompt's full blocks this step writes: filed now (later steps read after it).
                keys = request.prompt_keys(self.blocks.block_size)
                self.blocks.register(request.slot, keys[: request.num_cached // self.blocks.block_size])
        chainable = not need and not firsts and (
            self.overlap is True or (self.overlap is None and logits.device.type == "cuda"))
        return _Launched(chunks, tokens, host, {row: i for i, row in enumerate(need)}, prefill, decode, running,
                         prepare_start, forward_start, chainable, *_host_times(self.executor),
                         context=max(s + n for s, n in zip(starts, lengths)))

    def _complete(self, launched: _Launched) -> StepStats:
        """Read the samples of a launched step: stream them out, retire what ended, count the step.
        Rows of requests that ended meanwhile (a row queued after their last token) are dropped."""
        tokens = launched.tokens.tolist() if launched.tokens is not None else None
        read = time.perf_counter()
        sampled = 0
        for request, row in launched.sampled_rows().items():
            if request.is_finished:
                continue
            logits = launched.host_logits[launched.host_rows[row]] if row in launched.host_rows else None
            self._sample(request, logits, tokens[row] if tokens is not None else None)
            sampled += 1
        end = time.perf_counter()
        begin = max(launched.prepare_start, self._last_end)  # a step queued early counts from the last read
        forward_begin = max(launched.forward_start, self._last_end)
        self._last_end = end
        seconds = end - begin
        stats = StepStats(sum(c.length for c in launched.chunks), launched.prefill, launched.decode,
                          len(launched.chunks), sampled, seconds, self.queue_length, launched.running, time.time(),
                          read - forward_begin, forward_begin - begin, launched.host_compute_s,
                          launched.host_wait_s, launched.host_split_s, launched.context)
        self.history.append(stats)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step: %d token(s) (%d of prompts), %.1f ms: forward %.1f ms (host computing %.1f, of it "
                      "split parts %.1f; waiting on the GPU %.1f), before it %.1f ms", stats.tokens,
                      stats.prefill_tokens, 1e3 * seconds, 1e3 * stats.forward_s, 1e3 * stats.host_compute_s,
                      1e3 * stats.host_split_s, 1e3 * stats.host_wait_s, 1e3 * stats.prepare_s)
        self.total_steps += 1
        self.total_prompt_tokens += launched.prefill
        self.total_generated_tokens += sampled
        self.total_step_s += seconds
        self.total_forward_s += stats.forward_s
        if self.after_step is not None:
            self.after_step(stats)
        return stats

    def run_until_idle(self) -> None:
        """Step until every queued request has finished."""
        while self.has_work:
            self.step()

    def abort_running(self, message: str) -> None:
        """End every running request with ``finish_reason="error"`` (after a failed step)."""
        for request in list(self.running):
            request.error = message
            self._finish(request, "error", [], "")

    # ------------------------------------------------------------------ internals
    def _take_incoming(self) -> None:
        while self._incoming:
            request = self._incoming.popleft()
            if request.max_new_tokens == 0:
                self._finish(request, "length", [], "")
            else:
                self.waiting.append(request)

    def _retire_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self._finish(request, "cancelled", [], "")
        for request in [r for r in self.running if r.cancelled]:
            self._finish(request, "cancelled", [], "")

    def _admit(self) -> None:
        """First come, first served: the oldest waiting request goes first. A request is admitted when
        a sequence slot is free and the unreserved KV blocks hold its prompt and answer; where they do
        not, it and every later request wait. A request whose next uncached prompt blocks a running
        request is still to write waits for them (it takes them once written: prompts admitted together
        that share a system prompt read it once, not once each); later requests may go past it meanwhile,
        but only into the slots and blocks left once it has its own (its full charge, the blocks it
        will share counted too), so waiting for blocks never costs it its turn."""
        being_written = {key for r in self.running for key in self._blocks_to_write(r)}
        held_slots = held_blocks = 0  # kept for the requests passed over while their blocks are written
        index = 0
        while index < len(self.waiting) and len(self.free_slots) > held_slots:
            request = self.waiting[index]
            prefix = self._cached_prefix(request)
            charge = self.blocks.charge(request.context_needed, prefix)
            if charge + held_blocks > self.blocks.unreserved_blocks:
                break
            if self._next_block_key(request, len(prefix)) in being_written:
                held_slots, held_blocks, index = held_slots + 1, held_blocks + charge, index + 1
                continue
            del self.waiting[index]
            request.slot = self.free_slots.pop(0)
            self.blocks.admit(request.slot, request.context_needed, prefix)
            request.num_cached = request.cached_prompt_tokens = len(prefix) * self.blocks.block_size
            self.total_cached_prompt_tokens += request.cached_prompt_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            being_written.update(self._blocks_to_write(request))

    def _blocks_to_write(self, request: Request) -> list[tuple]:
        """The prefix-cache keys of the full prompt blocks ``request`` has yet to write (each is filed
        when the step that writes it is launched)."""
        if not self.prefix_cache or request.multimodal is not None or not request.in_prefill:
            return []
        size = self.blocks.block_size
        return request.prompt_keys(size)[request.num_cached // size:]

    def _shareable_keys(self, request: Request) -> list[tuple]:
        """The prefix-cache keys of the prompt blocks ``request`` may take from the cache: whole blocks
        before its last token (that one is always computed: its logits give the first new token);
        none where the cache is off or the prompt has images."""
        if not self.prefix_cache or request.multimodal is not None:
            return []
        usable = (request.prompt_len - 1) // self.blocks.block_size
        return request.prompt_keys(self.blocks.block_size)[:usable]

    def _next_block_key(self, request: Request, cached: int) -> tuple | None:
        """The key of the first block of ``request``'s prompt the cache could give but lacks, after its
        ``cached`` cached blocks; None where there is none."""
        keys = self._shareable_keys(request)
        return keys[cached] if cached < len(keys) else None

    def _cached_prefix(self, request: Request) -> list[int]:
        """The prefix cache's blocks for the start of ``request``'s prompt (:meth:`_shareable_keys`)."""
        return self.blocks.cached_prefix(self._shareable_keys(request))

    def _schedule(self, after: _Launched | None) -> list[_Chunk]:
        """Decode tokens of generating sequences first (they never starve), then prompt chunks.
        ``after``: a step queued but not read; requests whose last token it samples are left out."""
        room = self.max_step_tokens
        rows = self.max_logit_rows if self.max_logit_rows is not None else len(self.running)
        ending = set() if after is None else {
            request for request in after.sampled_rows() if len(request.output_ids) + 1 >= request.max_new_tokens}
        chunks = []
        for request in self.running:
            if request in ending:
                continue
            if not request.in_prefill and room > 0 and rows > 0:
                chunks.append(_Chunk(request, 1, True))
                room -= 1
                rows -= 1
        for request in self.running:
            if request.in_prefill and room > 0:
                used = self.max_step_tokens - room
                n = request.pending if request.pending <= room else self._chunk_length(used, room)
                samples = n == request.pending
                if samples and rows <= 0:  # no logit row left: read all but the last token now
                    n -= 1
                    samples = False
                    if n == 0:
                        continue
                chunks.append(_Chunk(request, n, samples))
                room -= n
                rows -= samples
        return chunks

    def _chunk_length(self, used: int, room: int) -> int:
        """Tokens of a prompt chunk after ``used`` tokens are already in the step, at most ``room``:
        enough to fill the largest token tier that can be filled, so the step runs a whole tier
        (the whole room without tiers, or when no tier fits)."""
        fitting = [size - used for size in self.chunk_sizes if used < size <= used + room]
        return fitting[-1] if fitting else room

    def _sample(self, request: Request, logits: torch.Tensor | None, argmax: int | None = None) -> None:
        if request.cancelled:  # cancelled during the step: no more output
            self._finish(request, "cancelled", [], "")
            return
        token = request.sampler(logits, argmax)
        text = request.append_token(token)
        if token in self.eos_ids or request.stop_hit is not None:
            reason = "stop"
        elif len(request.output_ids) >= request.max_new_tokens:
            reason = "length"
        else:
            request.emit(RequestOutput(request.request_id, [token], text, logprobs=_last_logprob(request)))
            return
        self._finish(request, reason, [token], text + request.flush_text(), _last_logprob(request))

    def _finish(self, request: Request, reason: str, token_ids: list[int], text: str,
                logprobs: list | None = None) -> None:
        if request.stop_hit is not None:
            request.output_ids = cut_at_stop(self.tokenizer, request.output_ids, request.stop)
            del request.logprobs[len(request.output_ids):]
        if request.slot is not None:
            if self.prefix_cache and request.multimodal is None and reason != "error":
                # Every full block of what was fed (prompt and answer): a next turn starts with it.
                fed = (request.prompt_ids + request.output_ids)[: request.num_cached]
                self.blocks.register(request.slot, prefix_keys(fed, self.blocks.block_size))
            self.blocks.release(request.slot)
            self.free_slots.append(request.slot)
            self.free_slots.sort()
            request.slot = None
        if request in self.running:  # before the output goes out: a reader may look at the stats at once
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_s = time.perf_counter()
        request.emit(RequestOutput(request.request_id, token_ids, text, True, reason, request.error, logprobs))

    # ------------------------------------------------------------------ metrics
    def stats(self, window_s: float = 10.0) -> dict:
        """Queue, running sequences, totals and recent throughput (tokens/s over the last ``window_s``)."""
        now = time.time()
        history = list(self.history)  # one C-level copy: safe while the engine thread appends
        recent = [s for s in history if now - s.end_time <= window_s]
        # Over the window, or since the first recent step began when the server was idle before it.
        span = max(min(window_s, now - recent[0].end_time + recent[0].seconds), 1e-9) if recent else 1.0
        return {
            "queue_length": self.queue_length,
            "running": len(self.running),
            "free_slots": len(self.free_slots),
            "kv_tokens_reserved": self.kv_reserved,
            "kv_tokens": self.kv_tokens,
            "kv_block_size": self.blocks.block_size,
            "kv_blocks": self.blocks.num_blocks,
            "kv_blocks_used": self.blocks.used_blocks,
            "kv_blocks_reserved": self.blocks.committed_blocks,
            "max_seqs": self.max_seqs,
            "max_context": self.max_context,
            "steps": self.total_steps,
            "overlapped_steps": self.total_overlapped,
            "prompt_tokens": self.total_prompt_tokens,
            "prompt_tokens_cached": self.total_cached_prompt_tokens,
            "kv_blocks_cached": self.blocks.cached_blocks,
            "generated_tokens": self.total_generated_tokens,
            "busy_s": round(self.total_step_s, 4),
            "scheduling_s": round(self.total_step_s - self.total_forward_s, 4),
            "scheduling_ms_per_step": (self.total_step_s - self.total_forward_s) * 1e3 / max(self.total_steps, 1),
            "generated_tokens_per_s": sum(s.sampled for s in recent) / span if recent else 0.0,
            "step_tokens_per_s": sum(s.tokens for s in recent) / span if recent else 0.0,
            "last_step": asdict(history[-1]) if history else None,
        }


def _multimodal_inputs(chunks: list[_Chunk]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Rotary positions [3, T] of a step's tokens and the image features replacing some of its rows.

    A text-only sequence's positions are its cache positions on all three rows (what ordinary
    rotary computes); a prompt with images uses its multimodal positions, and tokens after its
    prompt their cache position plus the prompt's delta.
    """
    positions, rows, vectors, offset = [], [], [], 0
    for chunk in chunks:
        request, start, n = chunk.request, chunk.request.num_cached, chunk.length
        mm = request.multimodal
        if mm is None:
            positions.append(torch.arange(start, start + n).expand(3, n))
        else:
            inside = min(n, max(0, request.prompt_len - start))  # prompt tokens in this chunk
            positions.append(mm.positions[:, start : start + inside])
            if inside < n:
                positions.append((torch.arange(start + inside, start + n) + mm.delta).expand(3, n - inside))
            if mm.embeds is not None:
                hit = (mm.rows >= start) & (mm.rows < start + inside)
                if bool(hit.any()):
                    rows.append(mm.rows[hit] - start + offset)
                    vectors.append(mm.embeds[hit])
        offset += n
    embeds = (torch.cat(rows), torch.cat(vectors)) if rows else None
    return torch.cat(positions, dim=1).to(torch.long), embeds


def _last_logprob(request: Request) -> list | None:
    """The log-probability record of the token just sampled, as a one-item list (None: not asked)."""
    return [request.logprobs[-1]] if request.params.logprobs is not None and request.logprobs else None
