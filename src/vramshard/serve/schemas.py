"""Request bodies of the OpenAI API (the fields vramshard understands) and the response shapes.

Types are strict (a string where a number belongs is an error, not coerced); unknown fields are
ignored, as OpenAI's own server does for fields it does not know.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings per request


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


MAX_LOGIT_BIAS = 300  # tokens a request may bias (OpenAI's limit)


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # an extension (vLLM and llama.cpp accept it too)
    min_p: float | None = Field(None, ge=0, le=1)  # an extension (vLLM and llama.cpp accept it too)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = Field(None)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # an extension (vLLM; llama.cpp's repeat_penalty)
    repeat_last_n: int | None = Field(None, ge=-1)  # an extension (llama.cpp's): the penalty's window, -1 all
    logprobs: Union[bool, int, None] = None  # chat: true/false; completions: alternatives per token (0-5)
    top_logprobs: int | None = Field(None, ge=0, le=20)  # chat: alternatives per token, with logprobs true
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class BudgetRequest(_Body):
    """POST /v1/budget: the new VRAM budget, a size (``"4GiB"``, bytes), ``"auto"`` or ``"none"`` / null."""

    vram: Union[str, int, None]


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None
    image_url: dict | str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; image parts are not understood by text models (ValueError)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r}")
            pieces.append(part.text or "")
        return "".join(pieces)

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.type == "image_url" for part in self.content)

    def vlm_content(self) -> list[dict]:
        """The content as parts for :func:`vramshard.vlm.chat_prompt`: text, and images from data URLs
        (InvalidInputError for a remote URL, bad base64 or a part type that is not understood)."""
        from ..errors import InvalidInputError
        from ..loading.image import decode_data_url

        if self.content is None or isinstance(self.content, str):
            return [{"type": "text", "text": self.content or ""}]
        parts = []
        for part in self.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text or ""})
            elif part.type == "image_url":
                url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
                if not isinstance(url, str):
                    raise InvalidInputError("an image_url part needs image_url.url, a data:image/...;base64 URL")
                parts.append({"type": "image", "image": decode_data_url(url)})
            else:
                raise InvalidInputError(f"content part type {part.type!r} is not supported; use text or image_url")
        return parts


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": id, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_}


def completion_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                      logprobs: dict | None = None) -> dict:
    """One choice of a completion (or of a streamed chunk). ``token_ids``: the generated ids, an
    extension (as vLLM's ``return_token_ids``) sent only for models without a tokenizer, whose
    text is always empty. ``logprobs``: see :func:`completion_logprobs`."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def chat_completion(id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(id: str, model: str, choices: list[dict], usage_: dict | None = None) -> dict:
    chunk = {"id": id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_delta(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_logprobs(entries, text_of, offset: int = 0) -> dict:
    """The completions API's ``logprobs`` of ``entries`` (:class:`TokenLogprob`), ``text_of``
    giving a token's text; ``offset``: characters of the answer before these tokens."""
    tokens = [text_of(e.token) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries, text_of) -> dict:
    """The chat API's ``logprobs`` (``content``: one item per token) of ``entries``."""
    def item(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "vramshard"}
