"""Chat completions with image parts (base64 data URLs) on a tiny Qwen2.5-VL, against the vlm API."""

import base64
import io

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from test_vlm_api import make_tiny_vl, random_image  # noqa: E402
from vramshard import vlm  # noqa: E402
from vramshard.demo_model import ensure_demo_model  # noqa: E402
from vramshard.engine import Engine  # noqa: E402
from vramshard.runtime.engine_loop import EngineLoop  # noqa: E402
from vramshard.serve.app import ServerState, create_app  # noqa: E402

NAME = "tiny-vl"


def data_url(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def serve(engine, name=NAME):
    loop = EngineLoop(engine.scheduler(max_seqs=2, max_context=1024))
    state = ServerState(loop, engine.tokenizer, name, executor=engine.executor, engine=engine)
    return loop, TestClient(create_app(state))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return vlm.load(make_tiny_vl(tmp_path_factory.mktemp("tiny_vl")), device="cpu")


@pytest.fixture(scope="module")
def client(engine):
    loop, client = serve(engine)
    yield client
    loop.close()


def chat(client, content, **extra):
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_image_parts_answer_as_the_vlm_api(client, engine):
    pictures = [random_image(140, 196, seed=1), random_image(84, 112, seed=2)]
    content = [{"type": "image_url", "image_url": {"url": data_url(pictures[0])}},
               {"type": "image_url", "image_url": {"url": data_url(pictures[1])}},
               {"type": "text", "text": "What is in the image?"}]
    response = chat(client, content)
    assert response.status_code == 200, response.text
    data = response.json()
    expected = vlm.generate_chat(engine, "What is in the image?", pictures, max_new_tokens=8)
    assert data["choices"][0]["message"]["content"] == engine.tokenizer.decode(expected)
    prompt = vlm.chat_prompt(engine, "What is in the image?", pictures)
    assert data["usage"]["prompt_tokens"] == len(prompt.ids)
    assert data["usage"]["completion_tokens"] == len(expected)
    # Streaming gives the same text.
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                             "temperature": 0, "stream": True}) as streamed:
        text = "".join(__import__("json").loads(line[6:])["choices"][0]["delta"].get("content", "")
                       for line in streamed.iter_lines() if line.startswith("data: {"))
    assert text == engine.tokenizer.decode(expected)
    # Text-only chats still go through the continuous batching.
    assert chat(client, "Hello").status_code == 200


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "not a data URL"),
    ("data:image/png;base64,@@@", "invalid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
])
def test_bad_image_parts_get_400(client, url, message):
    response = chat(client, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}])
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_text_model_refuses_image_parts(tmp_path_factory):
    text_engine = Engine.load(ensure_demo_model(tmp_path_factory.mktemp("cache")), device="cpu")
    loop, client = serve(text_engine)
    try:
        response = chat(client, [{"type": "image_url", "image_url": {"url": data_url(random_image(56, 56))}},
                                 {"type": "text", "text": "hi"}])
        assert response.status_code == 400
        assert "text model" in response.json()["error"]["message"]
    finally:
        loop.close()
