"""A real `vramshard serve` process on a loopback port, driven by the official openai client."""

import json
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from benchmarks.server_load import stop_server  # noqa: E402,F401 - test_budget imports it from here
from benchmarks import server_load  # noqa: E402
from vramshard import Engine  # noqa: E402
from vramshard.demo_model import ensure_demo_model  # noqa: E402

KEY = "sk-test-key"
MODEL = "demo"
CONTEXT = 512


def start_server(model_dir, *extra, timeout=90.0):
    """`vramshard serve` of the demo model on the CPU, on a free loopback port; returns (process, base url)."""
    return server_load.start_server(model_dir, "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL,
                                    *extra, timeout=timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.load(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def server(model_dir):
    process, url = start_server(model_dir, "--api-key", KEY, "--max-seqs", 4, "--max-context", CONTEXT, "--threads", 1)
    yield url
    stop_server(process)
    assert process.returncode is not None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def _text(engine, ids):
    return engine.tokenizer.decode(ids)


PROMPTS = ["The plan is printed as a table", "A model with eight billion", "vramshard"]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # no key needed for health


def test_completions_greedy_equal_engine_generate(client, engine):
    for prompt, n in zip(PROMPTS, (12, 5, 20)):
        expected = engine.generate([engine.tokenizer.encode(prompt)], n)[0]
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        assert result.choices[0].text == _text(engine, expected)
        assert result.usage.completion_tokens == len(expected)
        assert result.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks) == _text(engine, expected)
        assert chunks[-1].choices[0].finish_reason == result.choices[0].finish_reason


def test_batch_of_prompts_and_token_ids(client, engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    expected = [_text(engine, out) for out in engine.generate(ids, 8)]
    result = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == expected
    result = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0)
    assert result.choices[0].text == expected[0]


def test_chat_greedy_equal_engine_generate(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tier?"}]
    expected = _text(engine, engine.generate([engine.tokenizer.encode_chat(messages)], 10)[0])
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert result.choices[0].message.content == expected and result.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == result.choices[0].finish_reason


def test_stop_strings(client, engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    full = _text(engine, engine.generate([ids], 24, temperature=0.9, seed=5)[0])
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    expected = full[: full.index(stop)]  # text-level: cut right before the stop string
    for stream in (False, True):
        result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0.9, seed=5,
                                           stop=["never-there", stop], stream=stream)
        chunks = list(result) if stream else [result]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_are_independent_requests(client, engine):
    messages = [{"role": "user", "content": "Tell me about tiers."}]
    ids = engine.tokenizer.encode_chat(messages)
    expected = [_text(engine, out) for out in engine.generate([ids] * 3, 10, temperature=0.9, seed=7)]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.9,
                                            seed=7, n=3)
    assert [c.message.content for c in sorted(result.choices, key=lambda c: c.index)] == expected
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.9,
                                            seed=7, n=3, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == expected


def _post(server, path, body, key=KEY, raw=False):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if raw else json.dumps(body)
    return httpx.post(f"{server}{path}", content=content, headers=headers, timeout=30)


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", '{"model": "demo", "prompt": ', True, None, 400),
    ("not an object", "/v1/completions", "[1, 2]", True, None, 400),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, False, "max_tokens", 400),
    ("wrong type nested", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     False, None, 400),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, False,
     "max_tokens", 400),
    ("huge max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**30}, False,
     "max_tokens", 400),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "plan " * 800, "max_tokens": 4}, False,
     None, 400),
    ("chat too long", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 900}]},
     False, None, 400),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, False, "messages", 400),
    ("unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "king", "content": "hi"}]},
     False, None, 400),
    ("image for a text model", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, False, "messages", 400),
    ("bad token id", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6], "max_tokens": 2}, False,
     "prompt", 400),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2}, False, "prompt", 400),
    ("n too big", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 1000}, False, "n", 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, False, "model", 404),
    ("presence_penalty out of range", "/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 3},
     False, "presence_penalty", 400),
    ("logit_bias key not a token", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"cat": 5}},
     False, "logit_bias", 400),
    ("logit_bias token past the vocabulary", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1000000": 5}}, False,
     "logit_bias", 400),
    ("logit_bias value out of range", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 500}},
     False, "logit_bias", 400),
    ("logprobs beyond 5", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 9}, False, "logprobs", 400),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, False, "top_logprobs", 400),
    ("top_logprobs beyond 20", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                       "logprobs": True, "top_logprobs": 30}, False, "top_logprobs", 400),
]


@pytest.mark.parametrize("name,path,body,raw,param,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, name, path, body, raw, param, status):
    response = _post(server, path, body, raw=raw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)
    assert httpx.get(f"{server}/health").status_code == 200


def test_logit_bias_and_penalties_reach_the_sampler(client, engine):
    """A +100 bias makes greedy decoding repeat that token; penalties are accepted and applied
    (a strong frequency penalty stops the biased token from winning every step)."""
    token = 42
    text = engine.tokenizer.decode([token] * 5)
    biased = client.completions.create(model=MODEL, prompt="The plan", max_tokens=5, temperature=0,
                                       logit_bias={str(token): 100})
    assert biased.choices[0].text == text
    mild = client.completions.create(model=MODEL, prompt="The plan", max_tokens=5, temperature=0,
                                     logit_bias={str(token): 3}, frequency_penalty=2.0, presence_penalty=2.0)
    plain = client.completions.create(model=MODEL, prompt="The plan", max_tokens=5, temperature=0)
    assert mild.choices[0].text != text
    repeated = client.completions.create(model=MODEL, prompt="The plan", max_tokens=5, temperature=0,
                                         extra_body={"repetition_penalty": 1.3})
    assert repeated.choices[0].text and plain.choices[0].text



def test_the_repeat_window_reaches_the_sampler(client, engine):
    """repeat_last_n (an extension, llama.cpp's): the answer is the engine's with that window, not the whole one's."""
    ids = engine.tokenizer.encode("The plan")
    windowed = engine.tokenizer.decode(engine.generate([ids], 8, repetition_penalty=3.0, repeat_last_n=2)[0])
    assert windowed != engine.tokenizer.decode(engine.generate([ids], 8, repetition_penalty=3.0)[0])
    answer = client.completions.create(model=MODEL, prompt="The plan", max_tokens=8, temperature=0,
                                       extra_body={"repetition_penalty": 3.0, "repeat_last_n": 2})
    assert answer.choices[0].text == windowed


def test_min_p_reaches_the_sampler(client):
    """min_p (an extension, as in vLLM and llama.cpp) of 1 keeps only the likeliest token: sampling at a high
    temperature then gives the greedy answer, which it does not without it."""
    def answer(**extra):
        return client.completions.create(model=MODEL, prompt="The plan", max_tokens=8, temperature=5.0, seed=3,
                                         extra_body=extra).choices[0].text

    greedy = client.completions.create(model=MODEL, prompt="The plan", max_tokens=8, temperature=0).choices[0].text
    assert answer(min_p=1.0) == greedy
    assert answer() != greedy


def test_logprobs_are_the_models_and_stream_as_they_come(client, engine):
    """Greedy tokens carry their log-probability under the model (the engine's own logits, log-softmaxed)
    and it is the best of the alternatives; streamed chunks carry the same, chat and completions."""
    prompt = "The plan"
    ids = engine.tokenizer.encode(prompt)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    logprobs = whole.choices[0].logprobs
    answer = engine.generate([ids], 6)[0]
    assert logprobs.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in answer]
    reference = torch.log_softmax(engine.logits(ids + answer[:-1]).float(), dim=-1)[len(ids) - 1:]
    expected = [float(reference[i, t]) for i, t in enumerate(answer)]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
    streamed = []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(expected, abs=1e-4)
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content).startswith(chat.choices[0].message.content)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True, stream=True)
    streamed_chat = [c.logprob for chunk in chunks for choice in chunk.choices if choice.logprobs
                     for c in choice.logprobs.content]
    assert streamed_chat == pytest.approx([c.logprob for c in content], abs=1e-6)
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0].logprobs is None


def test_api_key_is_required(server, client):
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key=None).status_code == 401
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key="sk-wrong").status_code == 401
    assert httpx.get(f"{server}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=CONTEXT * 4)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_disconnect_mid_stream_frees_the_sequence(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    stats = lambda: httpx.get(f"{server}/v1/stats", headers=headers).json()  # noqa: E731
    before = stats()["generated_tokens"]
    body = {"model": MODEL, "prompt": "The plan", "max_tokens": 400, "temperature": 0.8, "stream": True}
    # Reading two events and leaving the block closes the connection mid-stream.
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=30) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen >= 2:
                break
    deadline = time.time() + 5
    while time.time() < deadline and stats()["running"]:
        time.sleep(0.05)
    after = stats()
    assert after["running"] == 0 and after["queue_length"] == 0
    assert after["generated_tokens"] - before < 200  # the disconnected stream stopped long before its 400 tokens
    assert after["engine_alive"] and after["plan"] == "cpu" and "vram_peak_bytes" in after
    assert after["decode_vs_plan"]["plan"] == "cpu" and after["decode_vs_plan"]["predicted_ms"] is None  # unplanned
    # (--threads 1; an unplanned CPU engine: nothing to fit, no run-ahead worker)
    cpu = dict(after["cpu"])
    busy, wanted = cpu.pop("other_cores_busy"), cpu.pop("other_cores_wanted")
    assert (busy is None) == (wanted is None) and (busy is None or 0 <= busy <= wanted)
    assert cpu == {"threads": 1, "calibration_pending": False, "calibrated_tiers": [], "worker_teams": {},
                   "load_changes": []}
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
