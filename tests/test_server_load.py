"""Bounded load test over loopback: 64 concurrent streaming clients, then random hang-ups."""

import asyncio
import importlib.util
import logging
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from vramshard import Engine  # noqa: E402
from vramshard.demo_model import ensure_demo_model  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "server_load", Path(__file__).resolve().parent.parent / "benchmarks" / "server_load.py")
load = sys.modules["server_load"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load)

log = logging.getLogger(__name__)
CLIENTS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def server(model_dir):
    process, url = load.start_server(model_dir, "--device", "cpu", "--dtype", "float32", "--max-seqs", 16,
                                     "--max-context", 256, "--served-model-name", "demo")
    yield url
    load.stop_server(process)


def test_64_streaming_clients_then_random_disconnects(server, model_dir):
    engine = Engine.load(model_dir, device="cpu", dtype="float32")
    specs = load.make_specs(CLIENTS, seed=1)
    ids = [engine.tokenizer.encode(prompt) for prompt, _ in specs]
    expected = [engine.tokenizer.decode(engine.generate([p], n)[0]) for p, (_, n) in zip(ids, specs)]
    assert len(set(expected)) > 1  # answers differ, so a mix-up would show

    report, results = asyncio.run(load.run_load(server, specs, "demo"))
    log.warning("load: %s", report)
    assert report.completed == CLIENTS and report.failed == 0
    for result, want, (_, max_tokens) in zip(results, expected, specs):
        assert result.status == 200 and result.done and len(result.ids) == 1
        assert result.text == want  # complete, in order, nobody else's tokens
        assert result.finish_reason in ("stop", "length") and 0 < result.completion_tokens <= max_tokens
    assert len({next(iter(r.ids)) for r in results}) == CLIENTS
    assert report.tokens_per_s > 0 and report.latency_p99_s >= report.latency_p50_s > 0

    report, results = asyncio.run(load.run_load(server, specs, "demo", disconnect=0.4, seed=2))
    log.warning("load with disconnects: %s", report)
    assert 0 < report.disconnected < CLIENTS and report.failed == 0
    for result, want in zip(results, expected):
        if result.disconnected:
            assert want.startswith(result.text)
        else:
            assert result.done and result.text == want

    deadline = time.time() + 10
    while time.time() < deadline:
        stats = httpx.get(f"{server}/v1/stats").json()
        if stats["running"] == 0 and stats["queue_length"] == 0:
            break
        time.sleep(0.1)
    assert stats["running"] == 0 and stats["queue_length"] == 0 and stats["free_slots"] == 16
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    prompt, n = specs[0]
    response = httpx.post(f"{server}/v1/completions", timeout=30,
                          json={"model": "demo", "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert response.json()["choices"][0]["text"] == expected[0]


def test_load_on_a_random_weight_shape_with_token_id_prompts(capsys):
    """`serve --shape` has no tokenizer: the load test sends token ids and counts tokens from usage."""
    code = load.main(["--shape", "tiny-llama", "--clients", "6,3", "--max-tokens", "5", "--max-seqs", "4",
                      "--server-args", "--device cpu --max-context 128", "--json"])
    reports = __import__("json").loads(capsys.readouterr().out)  # one server, loaded by 6 then 3 clients
    assert code == 0 and [r["completed"] for r in reports] == [6, 3] and not any(r["failed"] for r in reports)
    assert 6 <= reports[0]["completion_tokens"] <= 30 and 3 <= reports[1]["completion_tokens"] <= 15


def test_a_model_without_tokenizer_streams_its_token_ids_as_they_come():
    """No text to stream: each step's ids go out as a chunk (so time to first token is real), and
    the streamed ids are the non-streamed answer's."""
    process, url = load.start_server(None, "--shape", "tiny-llama", "--device", "cpu", "--max-context", "128",
                                     "--max-seqs", "4")
    try:
        specs = [([5 + i, 9, 11, 13], 6) for i in range(3)]
        report, results = asyncio.run(load.run_load(url, specs, "tiny-llama"))
        assert report.completed == 3
        for (prompt, n), result in zip(specs, results):
            assert result.events >= 2  # more than the final chunk
            assert len(result.token_ids) == result.completion_tokens
            whole = httpx.post(f"{url}/v1/completions", timeout=30,
                               json={"model": "tiny-llama", "prompt": prompt, "max_tokens": n, "temperature": 0})
            assert whole.json()["choices"][0]["token_ids"] == result.token_ids
    finally:
        load.stop_server(process)
