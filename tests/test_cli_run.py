"""`vramshard run`, `demo` and `chat` on the demo model, compared with the engine's own output."""

import io
import re
import shutil
import sys

import pytest

engine_module = pytest.importorskip("vramshard.engine")

from vramshard.cli.main import main  # noqa: E402
from vramshard.demo_model import DEMO_VERSION, ensure_demo_model  # noqa: E402

Engine = engine_module.Engine
PROMPT = "The plan is printed as a table"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def engine(model_dir):
    """The demo model on the CPU, its one-token projections' paths chosen: a shape's first calls take the
    candidates in turn (layers/cpu_linear.py), whose sums round differently, and the demo model's logits
    nearly tie, so the tests compare outputs made once the choice is settled."""
    from vramshard.layers import cpu_linear

    engine = Engine.load(model_dir, device="cpu")
    ids = engine.tokenizer.encode(PROMPT)
    cpu_linear.settle(lambda: engine.generate([ids], 4))
    return engine


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_streams_what_the_engine_generates(capsys, model_dir, engine):
    ids = engine.tokenizer.encode(PROMPT)
    expected = engine.tokenizer.decode(engine.generate([ids], 12, temperature=0.9, seed=3)[0])
    code, out, err = _run(capsys, "run", model_dir, "-p", PROMPT, "-n", 12, "--temp", 0.9, "--seed", 3,
                          "--device", "cpu")
    assert code == 0
    assert out == expected + ("" if expected.endswith("\n") else "\n")
    assert f"prompt {len(ids)} tokens" in err and "generated 12 tokens" in err and "tok/s" in err


def test_run_passes_the_penalties_to_the_sampler(capsys, model_dir, engine):
    ids = engine.tokenizer.encode(PROMPT)
    penalties = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=1.0)
    expected = engine.tokenizer.decode(engine.generate([ids], 16, **penalties)[0])
    assert expected != engine.tokenizer.decode(engine.generate([ids], 16)[0])  # the penalties change the answer
    code, out, err = _run(capsys, "run", model_dir, "-p", PROMPT, "-n", 16, "--repeat-penalty", 1.5,
                          "--presence-penalty", 0.5, "--frequency-penalty", 1.0, "--device", "cpu")
    assert code == 0 and out == expected + ("" if expected.endswith("\n") else "\n")


def test_run_passes_the_repeat_window_to_the_sampler(capsys, model_dir, engine):
    ids = engine.tokenizer.encode(PROMPT)
    windowed = engine.tokenizer.decode(engine.generate([ids], 16, repetition_penalty=3.0, repeat_last_n=2)[0])
    assert windowed != engine.tokenizer.decode(engine.generate([ids], 16, repetition_penalty=3.0)[0])
    code, out, err = _run(capsys, "run", model_dir, "-p", PROMPT, "-n", 16, "--repeat-penalty", 3.0,
                          "--repeat-last-n", 2, "--device", "cpu")
    assert code == 0 and out == windowed + ("" if windowed.endswith("\n") else "\n")


def test_run_passes_min_p_to_the_sampler(capsys, model_dir, engine):
    """--min-p 1 keeps only the likeliest token: a hot, seeded sample is then the greedy answer (and is not without it)."""
    ids = engine.tokenizer.encode(PROMPT)
    greedy = engine.tokenizer.decode(engine.generate([ids], 12)[0])
    assert engine.tokenizer.decode(engine.generate([ids], 12, temperature=5.0, seed=2)[0]) != greedy
    code, out, err = _run(capsys, "run", model_dir, "-p", PROMPT, "-n", 12, "--temp", 5.0, "--seed", 2,
                          "--min-p", 1.0, "--device", "cpu")
    assert code == 0 and out == greedy + ("" if greedy.endswith("\n") else "\n")


def test_run_stop_string_cuts_output(capsys, model_dir, engine):
    ids = engine.tokenizer.encode(PROMPT)
    full = engine.tokenizer.decode(engine.generate([ids], 24, temperature=0.9, seed=5)[0])
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    code, out, err = _run(capsys, "run", model_dir, "-p", PROMPT, "-n", 24, "--temp", 0.9, "--seed", 5,
                          "--stop", "never-there", "--stop", stop)
    assert code == 0
    assert out == full[: full.find(stop)] + "\n"
    assert "stopped at" in err


def test_run_chat_uses_the_template(capsys, model_dir, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = engine.tokenizer.encode_chat(messages)
    expected = engine.tokenizer.decode(engine.generate([ids], 6)[0])
    code, out, err = _run(capsys, "run", model_dir, "-p", "hi", "--chat", "--system", "Be brief.", "-n", 6)
    assert code == 0 and out.rstrip("\n") == expected.rstrip("\n")
    assert f"prompt {len(ids)} tokens" in err


def test_run_from_ids_without_tokenizer(capsys, model_dir, engine, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    expected = engine.generate([[5, 6, 7]], 5)[0]
    code, out, _ = _run(capsys, "run", bare, "--ids", "5,6,7", "-n", 5)
    assert code == 0 and out == ",".join(map(str, expected)) + "\n"
    code, out, err = _run(capsys, "run", bare, "-p", "hello")
    assert code == 3 and "--ids" in err and "Traceback" not in err
    code, _, err = _run(capsys, "run", bare, "--ids", "5,x")
    assert code == 3 and "comma-separated" in err


def test_demo_builds_and_reports(capsys, model_dir, monkeypatch):
    monkeypatch.setenv("VRAMSHARD_CACHE", str(model_dir.parent))
    code, out, err = _run(capsys, "demo", "-n", 6, "--seed", 0)
    assert code == 0
    assert out.startswith("vramshard runs language models")
    assert "random" in err and "tok/s" in err and f"demo-{DEMO_VERSION}" in err.replace("\n", "")


def test_chat_keeps_history_and_survives_ctrl_c(capsys, model_dir, engine, monkeypatch):
    seen = []
    real_stream = Engine.stream

    def stream(self, prompt_ids, *args, **kwargs):
        seen.append(list(prompt_ids))
        for count, token in enumerate(real_stream(self, prompt_ids, *args, **kwargs)):
            if len(seen) == 1 and count == 3:
                raise KeyboardInterrupt  # Ctrl-C in the middle of the first answer
            yield token

    monkeypatch.setattr(Engine, "stream", stream)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first question\nsecond\n/clear\nthird\n/exit\nnever\n"))
    code, out, err = _run(capsys, "chat", model_dir, "--system", "Be brief.", "-n", 5)
    assert code == 0
    assert len(seen) == 3  # "never" came after /exit
    assert "interrupted" in err
    # One scheduler for the conversation: the second turn took what the first had read from the cache.
    assert re.search(r"prompt \d+ tokens \(\d+ cached\)", err), err
    tok = engine.tokenizer
    system = {"role": "system", "content": "Be brief."}
    assert seen[0] == tok.encode_chat([system, {"role": "user", "content": "first question"}])
    # The second prompt holds the first question and its partial answer; after /clear only the system one.
    second = tok.decode(seen[1], skip_special_tokens=False)
    assert second.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nfirst question")
    assert second.count("<|im_start|>assistant\n") == 2 and second.endswith("second<|im_end|>\n<|im_start|>assistant\n")
    assert seen[2] == tok.encode_chat([system, {"role": "user", "content": "third"}])
