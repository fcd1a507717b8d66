"""The state of one generation request while the scheduler runs it.

A :class:`Request` holds what was asked (prompt, sampling, limits, stop strings), where it
stands (sequence slot, tokens cached, tokens generated, text released) and how it ended. Values
that follow from that state (is it still reading its prompt, how many tokens it feeds the
next step) are properties, so they cannot drift out of sync.

Each step's news for a request goes out as a :class:`RequestOutput` through the request's
``on_output`` callback (called on the scheduler's thread).
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ..loading.tokenizer import StopStringFilter, StreamDecoder
from .kv_cache import prefix_keys
from .sampler import Sampler, SamplingParams

if TYPE_CHECKING:
    import torch

_ids = itertools.count(1)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no sequence slot or KV blocks yet
    RUNNING = "running"  # owns a slot and reserved KV blocks; reading its prompt or generating
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request.

    token_ids: the tokens generated this step (raw: a token that completes a stop string is
    included here, though its text is not). text: the text released this step, cut before any
    stop string and never ending in half a character. finish_reason: ``"stop"`` (EOS or a stop
    string), ``"length"`` (``max_new_tokens``), ``"cancelled"`` or ``"error"``; None while running.
    """

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None  # TokenLogprob of each of token_ids, when the request asked for them


@dataclass
class MultimodalInput:
    """What images add to a prompt (Qwen2.5-VL): the multimodal rotary positions of its tokens,
    the shift of later positions, and the image features that replace the placeholder tokens.

    positions: int64 [3, P] for the P prompt tokens. delta: a token at cache position p after the
    prompt sits at rotary position p + delta (all three rows). rows: int64 [K], prompt positions of
    the image placeholder tokens; embeds: [K, hidden], their features (None: no image).
    """

    positions: "torch.Tensor"
    delta: int
    rows: "torch.Tensor"
    embeds: "torch.Tensor | None" = None


@dataclass(eq=False)
class Request:
    """One prompt to continue; created by :meth:`Scheduler.add` (or directly) and run by the scheduler."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: Sequence[str] = ()
    on_output: Callable[[RequestOutput], None] | None = None
    multimodal: MultimodalInput | None = None
    request_id: int = field(default_factory=lambda: next(_ids))

    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None  # sequence slot while running; keys its block table in the paged KV cache
    num_cached: int = 0  # tokens whose keys and values are in the cache
    cached_prompt_tokens: int = 0  # of the prompt, tokens taken from the prefix cache (not computed)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # text released so far (cut before any stop string)
    finish_reason: str | None = None
    stop_hit: str | None = None
    error: str | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None

    def __post_init__(self):
        self.prompt_ids = list(self.prompt_ids)
        self.stop = tuple(s for s in (self.stop or ()) if s)
        self.sampler = Sampler(self.params, self.prompt_ids)
        self.logprobs: list = []  # TokenLogprob per output token, when params.logprobs is set
        self._cancel = threading.Event()
        self._decoder: StreamDecoder | None = None
        self._stop_filter = StopStringFilter(self.stop)
        self._prompt_keys: tuple[int, list[tuple]] | None = None  # (block size, keys): see prompt_keys

    # ------------------------------------------------------------------ derived values
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def context_needed(self) -> int:
        """KV positions this request may fill: its whole prompt and every token it may generate."""
        return self.prompt_len + self.max_new_tokens

    @property
    def in_prefill(self) -> bool:
        """Still reading its prompt (some prompt tokens are not cached yet)."""
        return self.num_cached < self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens known but not yet cached: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def prompt_keys(self, block_size: int) -> list[tuple]:
        """The prefix-cache keys of the prompt's full blocks (made once)."""
        if self._prompt_keys is None or self._prompt_keys[0] != block_size:
            self._prompt_keys = (block_size, prefix_keys(self.prompt_ids, block_size))
        return self._prompt_keys[1]

    def next_input(self, n: int) -> list[int]:
        """The next ``n`` uncached token ids (prompt tokens, or the last sampled token)."""
        tokens = self.prompt_ids[self.num_cached : self.num_cached + n]
        if len(tokens) < n:
            start = max(self.num_cached - self.prompt_len, 0)
            tokens += self.output_ids[start : start + n - len(tokens)]
        return tokens

    # ------------------------------------------------------------------ control
    def cancel(self) -> None:
        """Ask for this request to end; the scheduler frees it at the next step boundary (any thread)."""
        self._cancel.set()

    # ------------------------------------------------------------------ used by the scheduler
    def attach_tokenizer(self, tokenizer) -> None:
        self._decoder = StreamDecoder(tokenizer) if tokenizer is not None else None

    def append_token(self, token: int) -> str:
        """Record a sampled token; return the text it releases (cut at a stop string)."""
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        self.output_ids.append(token)
        if self.sampler.last is not None:
            self.logprobs.append(self.sampler.last)
        if self._decoder is None:
            return ""
        released = self._stop_filter.feed(self._decoder.feed(token))
        self.text += released
        self.stop_hit = self._stop_filter.hit
        return released

    def flush_text(self) -> str:
        """At the end of generation: the text held back (a partial character or stop-string prefix)."""
        if self._decoder is None or self.stop_hit is not None:
            return ""
        released = self._stop_filter.feed(self._decoder.flush()) + self._stop_filter.flush()
        self.text += released
        return released

    def emit(self, output: RequestOutput) -> None:
        if self.on_output is not None:
            self.on_output(output)


def cut_at_stop(tokenizer, tokens: list[int], stop: Sequence[str]) -> list[int]:
    """The longest prefix of ``tokens`` whose text contains no stop string (as ``Engine.generate``)."""
    if not stop or tokenizer is None or not any(s in tokenizer.decode(tokens) for s in stop):
        return tokens
    for n in range(len(tokens)):
        if any(s in tokenizer.decode(tokens[: n + 1]) for s in stop):
            return tokens[:n]
    return tokens
