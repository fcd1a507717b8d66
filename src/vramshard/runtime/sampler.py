"""Choosing the next token from logits: greedy, or temperature with top-k / top-p / min-p; before either,
the logits may be adjusted by a bias per token and by penalties on the tokens already seen.

The penalties follow the APIs users know them from: ``presence_penalty`` and
``frequency_penalty`` as OpenAI defines them (subtracted from the logits of tokens generated so
far: once for any occurrence, and per occurrence), ``repetition_penalty`` as Hugging Face
transformers, vLLM and llama.cpp's ``repeat_penalty`` do (the logit of every token of the prompt
or of the answer so far is divided by it when positive, multiplied when negative), over the last
``repeat_last_n`` tokens of the two where that is set (llama.cpp's ``repeat_last_n``).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy (after any bias and penalties)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI: -2 .. 2
    frequency_penalty: float = 0.0  # OpenAI: -2 .. 2
    repetition_penalty: float = 1.0  # transformers / vLLM / llama.cpp: > 0, 1 is off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # report the chosen token's log-probability and this many alternatives
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the likeliest (llama.cpp, vLLM); 0: off
    # The tokens repetition_penalty looks at: -1 the whole prompt and answer (transformers, vLLM), N > 0 the last N
    # of them (llama.cpp's repeat_last_n, whose default is 64), 0 none (the penalty off, as in llama.cpp).
    repeat_last_n: int = -1

    def __post_init__(self):
        if self.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidInputError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidInputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise InvalidInputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repeat_last_n < -1:
            raise InvalidInputError(f"repeat_last_n must be -1 (all), 0 (off) or a token count, got {self.repeat_last_n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidInputError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise InvalidInputError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got "
                                        f"{token}: {bias}")

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repeats or self.logit_bias)

    @property
    def repeats(self) -> bool:
        """Whether the repetition penalty acts (a factor other than 1 over a window of at least one token)."""
        return self.repetition_penalty != 1 and self.repeat_last_n != 0


MAX_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of a chosen token under the model's distribution (the raw logits, as
    vLLM reports them), and the ``top`` likeliest tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Samples for one sequence; owns its random generator so results do not depend on batching,
    and counts the tokens it has chosen (for the penalties). ``prompt_ids``: the prompt, which
    ``repetition_penalty`` also penalises."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.generated: Counter[int] = Counter()
        self.prompt = frozenset(prompt_ids) if params.repeats and params.repeat_last_n < 0 else frozenset()
        # The last repeat_last_n tokens of the prompt and answer, where the penalty looks at a window.
        self.recent: deque[int] | None = None
        if params.repeats and params.repeat_last_n > 0:
            self.recent = deque(list(prompt_ids)[-params.repeat_last_n:], maxlen=params.repeat_last_n)
        self.last: TokenLogprob | None = None  # of the last token chosen, when params.logprobs is set

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: the token is their argmax, which a step can take for all its
        rows at once (:meth:`__call__`'s ``argmax``)."""
        return self.params.temperature == 0 and not self.params.adjusts_logits

    @property
    def needs_logits(self) -> bool:
        """Whether choosing a token reads the whole row of logits (else their argmax is enough)."""
        return not self.plain_greedy or self.params.logprobs is not None

    def __call__(self, logits: torch.Tensor | None, argmax: int | None = None) -> int:
        """logits [V] (any device) → token id. ``argmax``: the logits' argmax when the caller has
        it already (used only by :attr:`plain_greedy` samplers, which then need no ``logits``
        unless they report log-probabilities)."""
        p = self.params
        if logits is None:
            if self.needs_logits or argmax is None:
                raise ValueError("this sampler reads the logits; only a plain greedy one takes the argmax alone")
            self.record(argmax)
            return argmax
        raw = logits
        if p.adjusts_logits:
            logits = self.adjust(logits.float().cpu())
        if p.temperature == 0:
            token = argmax if argmax is not None and self.plain_greedy else int(torch.argmax(logits))
        else:
            token = self._sample(logits)
        self.record(token)
        if p.logprobs is not None:
            self.last = token_logprob(raw, token, p.logprobs)
        return token

    def record(self, token: int) -> None:
        """``token`` was chosen: the penalties count it from the next choice on."""
        self.generated[token] += 1
        if self.recent is not None:
            self.recent.append(token)

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """Bias and penalties applied to float32 CPU logits [V] (a new tensor)."""
        p = self.params
        logits = logits.clone()
        vocab = logits.numel()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
            logits[ids] += torch.tensor([b for t, b in p.logit_bias if t < vocab])
        if p.repeats:
            window = set(self.recent) if self.recent is not None else self.prompt | self.generated.keys()
            seen = torch.tensor(sorted(t for t in window if t < vocab), dtype=torch.long)
            if seen.numel():
                values = logits[seen]
                logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.generated:
            ids = torch.tensor(list(self.generated), dtype=torch.long)
            counts = torch.tensor([self.generated[t] for t in self.generated.keys()], dtype=torch.float32)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def _sample(self, logits: torch.Tensor) -> int:
        return int(torch.multinomial(self.distribution(logits), 1, generator=self.generator))

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities [V] a token is drawn from (temperature > 0): ``logits`` [V] over the temperature,
        then top-k, top-p and min-p in transformers' order, each keeping at least one token (not normalised
        after top-p and min-p: :func:`torch.multinomial` takes weights)."""
        p = self.params
        logits = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0:  # (the likeliest token always stays)
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` [V], with the ``top`` likeliest tokens'."""
    logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)
