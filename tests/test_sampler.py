"""Sampling: greedy and temperature sampling, and the logit adjustments before them (OpenAI's
presence and frequency penalties and logit bias, transformers' repetition penalty)."""

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                   TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from vramshard.errors import InvalidInputError
from vramshard.runtime.sampler import Sampler, SamplingParams

V = 50


def _logits(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_is_transformers():
    prompt, generated = [3, 7, 7, 11], [20, 3, 41]
    sampler = Sampler(SamplingParams(repetition_penalty=1.3), prompt)
    for t in generated:
        sampler.generated[t] += 1
    logits = _logits()
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + generated]), logits[None].clone())[0]
    torch.testing.assert_close(sampler.adjust(logits), expected)


@pytest.mark.parametrize("last_n", [3, 6, 100])
def test_repetition_penalty_over_the_last_n_tokens_is_transformers_over_them(last_n):
    """repeat_last_n (llama.cpp's): the penalty looks at the last N tokens of the prompt and answer, which is
    transformers' penalty given those tokens alone; the window follows the tokens the sampler chooses."""
    prompt, logits = [3, 7, 7, 11, 8], _logits(6)
    sampler = Sampler(SamplingParams(repetition_penalty=1.3, repeat_last_n=last_n), prompt)
    chosen = [sampler(_logits(7 + i)) for i in range(3)]  # greedy, penalised: the window moves on with them
    window = (prompt + chosen)[-last_n:]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([window]), logits[None].clone())[0]
    torch.testing.assert_close(sampler.adjust(logits), expected)
    if last_n < len(prompt + chosen):
        assert not torch.equal(expected, RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + chosen]),
                                                                               logits[None].clone())[0])


def test_repeat_last_n_zero_turns_the_penalty_off():
    params = SamplingParams(repetition_penalty=1.3, repeat_last_n=0)
    assert not params.adjusts_logits and Sampler(params, [1, 2]).plain_greedy
    logits = _logits(8)
    torch.testing.assert_close(Sampler(params, list(range(V))).adjust(logits), logits)


def test_presence_and_frequency_penalties_are_openais():
    sampler = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2, 3])
    for t in (5, 5, 5, 9):
        sampler.generated[t] += 1
    logits = _logits(1)
    expected = logits.clone()
    expected[5] -= 0.5 + 0.25 * 3
    expected[9] -= 0.5 + 0.25 * 1  # the prompt's tokens are not penalised (OpenAI counts the answer)
    torch.testing.assert_close(sampler.adjust(logits), expected)


def test_logit_bias_steers_greedy_and_the_counts_follow_the_choices():
    logits = _logits(2)
    low = int(torch.argmin(logits))
    sampler = Sampler(SamplingParams(logit_bias=((low, 100.0), (V + 5, 1.0))))  # a token past the vocabulary: ignored
    assert [sampler(logits) for _ in range(3)] == [low] * 3
    assert sampler.generated == {low: 3}
    # With a frequency penalty, a mild bias wins only until the penalty has grown past it.
    top = int(torch.argmax(logits))
    margin = float(logits[top] - logits.sort(descending=True).values[1])
    damped = Sampler(SamplingParams(frequency_penalty=2.0))
    tokens = [damped(logits) for _ in range(4)]
    assert tokens[0] == top and (margin > 2 * 4 or tokens.count(top) < 4)


def test_no_adjustment_is_plain_argmax_and_sampling_is_seeded():
    logits = _logits(3)
    assert not SamplingParams().adjusts_logits
    assert Sampler(SamplingParams())(logits) == int(torch.argmax(logits))
    draws = [[Sampler(SamplingParams(temperature=1.0, seed=5, presence_penalty=0.1))(logits) for _ in range(1)]
             for _ in range(2)]
    assert draws[0] == draws[1]


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("logit_bias", ((1, 101.0),)),
                                         ("logit_bias", ((-1, 1.0),)), ("min_p", 1.5), ("min_p", -0.1),
                                         ("repeat_last_n", -2)])
def test_out_of_range_settings_are_refused(field, value):
    with pytest.raises(InvalidInputError, match=field):
        SamplingParams(**{field: value})


def test_logprobs_are_of_the_raw_distribution_with_the_top_alternatives():
    logits = _logits(4)
    sampler = Sampler(SamplingParams(logprobs=2, logit_bias=((0, 50.0),)))  # the bias moves the choice, not the report
    assert sampler(logits) == 0
    reference = torch.log_softmax(logits, dim=-1)
    assert sampler.last.token == 0 and sampler.last.logprob == pytest.approx(float(reference[0]))
    best = torch.topk(reference, 2)
    assert [t for t, _ in sampler.last.top] == best.indices.tolist()
    assert Sampler(SamplingParams())(logits) is not None and Sampler(SamplingParams()).last is None
    with pytest.raises(InvalidInputError, match="logprobs"):
        SamplingParams(logprobs=25)


def test_a_step_wide_argmax_is_used_only_by_plain_greedy_samplers():
    """The scheduler hands each row the argmax it computed for the whole step at once; a greedy
    sampler on raw logits takes it, one that adjusts the logits or samples computes its own."""
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    plain = Sampler(SamplingParams(temperature=0))
    assert plain.plain_greedy and plain(logits, argmax=1) == 1
    assert plain.generated[1] == 1
    biased = Sampler(SamplingParams(temperature=0, logit_bias=((2, 5.0),)))
    assert not biased.plain_greedy and biased(logits, argmax=1) == 2
    sampled = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert not sampled.plain_greedy


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.7, 0, 1.0, 0.1), (1.3, 20, 0.9, 0.0), (1.0, 0, 0.8, 0.05),
                                                          (2.0, 10, 0.95, 0.2), (1.0, 0, 1.0, 1.0)])
def test_top_k_top_p_and_min_p_draw_from_transformers_distribution(temperature, top_k, top_p, min_p):
    """The distribution a token is drawn from is transformers' warpers' (temperature, top-k, top-p, min-p in that
    order): the same tokens kept, with the same probabilities once normalised; min-p 1 keeps the likeliest alone."""
    logits = _logits(5)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ours = Sampler(params).distribution(logits)
    warped = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    for warper in ([TopKLogitsWarper(top_k)] if top_k else []) + [TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)]:
        warped = warper(None, warped)
    expected = torch.softmax(warped[0], dim=-1)
    assert torch.equal(ours > 0, expected > 0)
    torch.testing.assert_close(ours / ours.sum(), expected)
    if min_p == 1.0:
        assert int((ours > 0).sum()) == 1 and int(torch.argmax(ours)) == int(torch.argmax(logits))
        assert {Sampler(SamplingParams(temperature=5.0, min_p=1.0, seed=s))(logits) for s in range(5)} == \
            {int(torch.argmax(logits))}
