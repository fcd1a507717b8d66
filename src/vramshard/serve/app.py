"""The OpenAI-compatible HTTP API over an :class:`~vramshard.runtime.engine_loop.EngineLoop`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
streaming through server-sent events or not), ``GET /health``, ``GET /v1/stats`` and
``GET|POST /v1/budget`` (the VRAM budget in force and in use; a new budget, applied at the next step). Every request
of every client goes into the engine loop's continuous batching with its own sampling settings;
``n`` choices are ``n`` independent requests (seed ``seed + i`` for choice i). A client that
disconnects cancels its requests at once, which frees their KV slots at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ..errors import InvalidInputError
from ..runtime.engine_loop import EngineLoop, RequestHandle
from ..runtime.request import RequestOutput
from ..runtime.sampler import SamplingParams
from . import schemas
from .errors import APIError, bad_request, install_handlers

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the endpoints need: the engine loop, the tokenizer, names and limits."""

    loop: EngineLoop
    tokenizer: object | None
    model_name: str
    api_key: str | None = None
    executor: object | None = None  # for VRAM and plan in /v1/stats
    created: int = 0
    engine: object | None = None  # the Engine: budget, decode check; a VLM's chat messages may hold images
    image_lock: threading.Lock = field(default_factory=threading.Lock)  # one image request at a time

    @property
    def max_context(self) -> int:
        scheduler = self.loop.scheduler
        return min(scheduler.max_context, scheduler.kv_tokens)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state.loop``."""
    state.created = state.created or int(time.time())

    async def check_key(request: Request) -> None:
        if state.api_key is None or request.url.path == "/health":
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise APIError(401, "missing or wrong API key; send it as 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")

    app = FastAPI(title="vramshard", dependencies=[Depends(check_key)])
    install_handlers(app)

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse({"status": "error", "message": "the engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [schemas.model_card(state.model_name, state.created)]}

    @app.get("/v1/stats")
    async def stats():
        data = state.loop.stats()
        executor = state.executor
        if executor is not None:
            data["vram_peak_bytes"] = executor.peak_vram()
            data["plan"] = executor.placement.name
        if state.engine is not None:
            data["decode_vs_plan"] = state.engine.plan_check().summary()
            data["cpu"] = state.engine.cpu_stats()
        data["model"] = state.model_name
        return data

    @app.get("/v1/budget")
    async def get_budget():
        return _budget_state(state)

    @app.post("/v1/budget")
    async def set_budget(request: Request):
        body = await _parse(request, schemas.BudgetRequest)
        if state.engine is None:
            raise APIError(501, "this server cannot change its VRAM budget (no engine attached)", type="server_error")
        from ..errors import BudgetError

        try:
            state.engine.set_vram(body.vram)
        except (InvalidInputError, BudgetError) as exc:
            raise bad_request(str(exc), param="vram") from None
        # Adapt now rather than at the next request's first step: an idle server gives VRAM back
        # too. This waits for a step in progress to end (the engine thread may adapt first).
        await asyncio.to_thread(state.engine.poll_budget)
        return _budget_state(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, schemas.CompletionRequest)
        _check_common(state, body)
        if body.echo or body.best_of not in (None, 1) or body.suffix:
            raise bad_request("echo, best_of and suffix are not supported", param="echo")
        prompts = _completion_prompts(state, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        handles = _submit(state, prompts, body, [max_tokens] * len(prompts))
        lens = [len(p) for p in prompts for _ in range(body.n or 1)]
        return await _respond(request, state, body, handles, lens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, schemas.ChatRequest)
        _check_common(state, body)
        if body.tools:
            raise bad_request("tools are not supported", param="tools")
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer, so chat messages cannot be encoded")
        if any(m.has_images() for m in body.messages):
            return await _chat_with_images(request, state, body)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as exc:
            raise bad_request(f"{exc} is not supported: {state.model_name} is a text model",
                              param="messages") from None
        prompt = state.tokenizer.encode_chat(messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            _check_context(state, len(prompt), 1)
            max_tokens = state.max_context - len(prompt)
        handles = _submit(state, [prompt], body, [max_tokens])
        lens = [len(prompt)] * len(handles)
        return await _respond(request, state, body, handles, lens, chat=True)

    return app


async def _respond(request: Request, state: ServerState, body, handles, lens: list[int], chat: bool):
    """The answer to a submitted request: server-sent events as tokens come, or, when not
    streaming, one response once every handle finished (``lens``: prompt tokens per handle)."""
    job = schemas.new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
        events = _chat_events if chat else _completion_events
        return _stream(handles, events(state, job, handles, lens, body))
    finished = await _wait(request, handles)
    asked = _logprobs(body) is not None
    text_of = _text_of(state)
    if chat:
        choices = [schemas.chat_choice(i, r.text, r.finish_reason,
                                       schemas.chat_logprobs(r.logprobs, text_of) if asked else None)
                   for i, r in enumerate(finished)]
    else:
        ids = state.tokenizer is None  # no text to send: the token ids instead
        choices = [schemas.completion_choice(i, r.text, r.finish_reason, list(r.output_ids) if ids else None,
                                             schemas.completion_logprobs(r.logprobs, text_of) if asked else None)
                   for i, r in enumerate(finished)]
    used = schemas.usage(sum(lens), sum(len(r.output_ids) for r in finished))
    response = schemas.chat_completion if chat else schemas.completion
    return response(job, state.model_name, choices, used)


# ---------------------------------------------------------------------- chat with images
async def _chat_with_images(request: Request, state: ServerState, body):
    """A chat whose messages hold images: rendered, preprocessed and run through the vision
    encoder on a worker thread (one such request at a time), then generated in the continuous
    batch beside every other request."""
    from .. import vlm
    from ..errors import VramshardError

    engine = state.engine
    if engine is None or not vlm.vision_names(engine.model):
        raise bad_request(f"image content parts are not supported: {state.model_name} is a text model",
                          param="messages")
    max_tokens = body.max_completion_tokens or body.max_tokens

    def vision_phase():
        with state.image_lock:
            messages = [{"role": m.role, "content": m.vlm_content()} for m in body.messages]
            prompt = vlm.chat_prompt(engine, messages)
            limit = max_tokens if max_tokens is not None else max(1, state.max_context - len(prompt.ids))
            _check_context(state, len(prompt.ids), limit)
            pixels, grid = vlm.check_image_inputs(engine, prompt.pixel_values, prompt.image_grid_thw)
            owners = vlm.assign_images([prompt.ids], grid, engine.args)
            return prompt.ids, limit, vlm.encode_prompts(engine, [prompt.ids], pixels, grid, owners)[0]

    try:
        ids, limit, multimodal = await asyncio.to_thread(vision_phase)
    except VramshardError as exc:
        raise bad_request(str(exc), param="messages") from None
    handles = _submit(state, [ids], body, [limit], multimodal)
    return await _respond(request, state, body, handles, [len(ids)] * len(handles), chat=True)


def _budget_state(state: ServerState) -> dict:
    if state.engine is None:
        executor = state.executor
        return {"vram_budget": executor.budget if executor else None,
                "vram_planned": executor.need.total if executor else None, "adjustable": False}
    return {**state.engine.budget_state(), "adjustable": True}


# ---------------------------------------------------------------------- request checks
async def _parse(request: Request, model):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise bad_request(f"invalid value for {param or 'the body'}: {first['msg']}", param=param) from None


def _check_common(state: ServerState, body) -> None:
    if body.model != state.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       type="invalid_request_error", param="model", code="model_not_found")
    stops = body.stop_list()
    if len(stops) > schemas.MAX_STOP:
        raise bad_request(f"at most {schemas.MAX_STOP} stop strings, got {len(stops)}", param="stop")
    if stops and state.tokenizer is None:
        raise bad_request("stop strings need a tokenizer, and this model has none", param="stop")
    _logit_bias(state, body)  # checked here: a bad one is a 400 before anything is queued
    _logprobs(body)


def _logprobs(body) -> int | None:
    """Alternatives per token the request asks log-probabilities for (None: no logprobs). Chat:
    ``logprobs`` true with ``top_logprobs`` 0-20; completions: ``logprobs`` 0-5."""
    if isinstance(body, schemas.ChatRequest):
        if body.logprobs not in (None, True, False):
            raise bad_request("logprobs of a chat completion is true or false; ask for alternatives with "
                              "top_logprobs", param="logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None:
        raise bad_request("top_logprobs is for chat completions; completions take logprobs: N",
                          param="top_logprobs")
    if body.logprobs is None or body.logprobs is False:
        return None
    if body.logprobs is True or not 0 <= body.logprobs <= 5:
        raise bad_request(f"logprobs of a completion is a number of alternatives from 0 to 5, got {body.logprobs!r}",
                          param="logprobs")
    return body.logprobs


def _text_of(state: ServerState):
    """A token's text for logprobs (a model without a tokenizer: its id)."""
    tokenizer = state.tokenizer
    return (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else str


def _logit_bias(state: ServerState, body) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` ({"token id": bias in [-100, 100]}) as sampler pairs."""
    pairs = []
    vocab = state.loop.scheduler.vocab_size
    for key, bias in (body.logit_bias or {}).items():
        if not key.strip().isdigit() or (vocab and int(key) >= vocab):
            raise bad_request(f"logit_bias keys must be token ids of this model's vocabulary"
                              f"{f' (below {vocab})' if vocab else ''}, got {key!r}", param="logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias} for token {key}",
                              param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _check_context(state: ServerState, prompt_len: int, max_tokens: int) -> None:
    limit = state.max_context
    if prompt_len + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but the request asks "
                            f"for {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to "
                            "generate); shorten the prompt or lower max_tokens",
                       param="max_tokens" if prompt_len < limit else "messages", code="context_length_exceeded")


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            if state.tokenizer is None:
                raise bad_request("this model has no tokenizer; send the prompt as token ids", param="prompt")
            item = state.tokenizer.encode(item)
        if not item:
            raise bad_request("prompt is empty", param="prompt")
        prompts.append(item)
    return prompts


def _submit(state: ServerState, prompts: list[list[int]], body, max_tokens: list[int],
            multimodal=None) -> list[RequestHandle]:
    """Queue n requests per prompt; all or none (a bad one cancels those already queued).
    ``multimodal``: the prompt's images (one prompt), as :func:`vramshard.vlm.encode_prompts` makes them."""
    for prompt, limit in zip(prompts, max_tokens):
        _check_context(state, len(prompt), limit)
    n = body.n or 1
    sampling = dict(temperature=1.0 if body.temperature is None else body.temperature, top_k=body.top_k or 0,
                    top_p=1.0 if body.top_p is None else body.top_p, min_p=body.min_p or 0.0,
                    presence_penalty=body.presence_penalty or 0.0,
                    frequency_penalty=body.frequency_penalty or 0.0,
                    repetition_penalty=body.repetition_penalty or 1.0,
                    repeat_last_n=-1 if body.repeat_last_n is None else body.repeat_last_n,
                    logit_bias=_logit_bias(state, body),
                    logprobs=_logprobs(body))
    handles: list[RequestHandle] = []
    try:
        for prompt, limit in zip(prompts, max_tokens):
            for _ in range(n):
                seed = None if body.seed is None else body.seed + len(handles)
                params = SamplingParams(seed=seed, **sampling)
                handles.append(state.loop.submit(prompt, params, limit, body.stop_list(), multimodal=multimodal))
    except InvalidInputError as exc:
        for handle in handles:
            handle.cancel()
        raise bad_request(str(exc), param="prompt") from None
    return handles


# ---------------------------------------------------------------------- waiting and streaming
async def _wait(request: Request, handles: list[RequestHandle]):
    """The finished requests, in order; a client disconnect cancels them all."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    results = asyncio.ensure_future(asyncio.gather(*(h.aresult() for h in handles)))
    try:
        await asyncio.wait({watcher, results}, return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            for handle in handles:
                handle.cancel()
            raise APIError(499, "client closed the request")
        finished = results.result()
    finally:
        watcher.cancel()
        for handle in handles:
            handle.cancel()
    failed = [r for r in finished if r.finish_reason == "error"]
    if failed:
        raise APIError(500, failed[0].error or "generation failed", type="server_error")
    return finished


class _CancellingStream(StreamingResponse):
    """An SSE response that cancels its requests when it ends for any reason (disconnect included)."""

    def __init__(self, content, handles: list[RequestHandle]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._handles = handles

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for handle in self._handles:
                handle.cancel()


def _stream(handles: list[RequestHandle], events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return _CancellingStream(body(), handles)


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all handles as they come, until every one has finished."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle):
        async for output in handle:
            await queue.put((index, output))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(handles)
    try:
        while remaining:
            index, output = await queue.get()
            remaining -= output.finished
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()


def _error_event(output: RequestOutput) -> dict:
    return APIError(500, output.error or "generation failed", type="server_error").body()


async def _completion_events(state, job, handles, lens, body) -> AsyncIterator[dict]:
    generated = [0] * len(handles)
    offsets = [0] * len(handles)  # characters sent per choice (the logprobs' text_offset)
    text_of = _text_of(state)
    async for index, output in _merged(handles):
        generated[index] += len(output.token_ids)
        if output.finish_reason == "error":
            yield _error_event(output)
            return
        ids = list(output.token_ids) if state.tokenizer is None else None  # no text: stream the ids
        logprobs = schemas.completion_logprobs(output.logprobs, text_of, offsets[index]) if output.logprobs else None
        if output.text or output.finished or ids or logprobs:
            choice = schemas.completion_choice(index, output.text, output.finish_reason if output.finished else None,
                                               ids, logprobs)
            offsets[index] += len(output.text)
            yield schemas.completion(job, state.model_name, [choice], None)
    if body.stream_options and body.stream_options.include_usage:
        yield schemas.completion(job, state.model_name, [], schemas.usage(sum(lens), sum(generated)))


async def _chat_events(state, job, handles, lens, body) -> AsyncIterator[dict]:
    model = state.model_name
    for index in range(len(handles)):
        yield schemas.chat_chunk(job, model, [schemas.chat_delta(index, {"role": "assistant", "content": ""})])
    generated = [0] * len(handles)
    text_of = _text_of(state)
    async for index, output in _merged(handles):
        generated[index] += len(output.token_ids)
        if output.finish_reason == "error":
            yield _error_event(output)
            return
        logprobs = schemas.chat_logprobs(output.logprobs, text_of) if output.logprobs else None
        if output.text or logprobs:
            yield schemas.chat_chunk(job, model, [schemas.chat_delta(index, {"content": output.text}, None, logprobs)])
        if output.finished:
            yield schemas.chat_chunk(job, model, [schemas.chat_delta(index, {}, output.finish_reason)])
    if body.stream_options and body.stream_options.include_usage:
        yield schemas.chat_chunk(job, model, [], schemas.usage(sum(lens), sum(generated)))
