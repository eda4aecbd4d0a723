"""The HTTP face of the gateway: OpenAI's routes on FastAPI (what vLLM's own server runs on).

Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (header `X-Session-ID`
makes a call a turn of a session), `POST /v1/sessions/{id}/finish`, `GET /health` (200 while a worker serves the
namespace, else 503 `no_worker`), `GET /metrics` (Prometheus), and vLLM's RL routes (`producers.gateway.rl_routes`).
Every error is a JSON body in OpenAI's shape with a 4xx/5xx status, never a traceback; `stream: true` is answered as
server-sent events (the whole reply in one chunk: rollouts arrive whole).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from producers.gateway.openai_api import ChatRequest, CompletionRequest, FinishRequest, OpenAIError
from producers.gateway.rl_routes import NOT_SERVED, add_vllm_routes
from producers.gateway.service import Gateway

log = logging.getLogger(__name__)


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="rollout-streams gateway", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()[:5]]
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        error = OpenAIError(400, "; ".join(problems) or "invalid request", param=".".join(map(str, first[1:2])) or None)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """No such route (or method), in OpenAI's shape; a vLLM route the gateway does not serve says why."""
        path = request.url.path
        message = f"{request.method} {path}: {exc.detail}"
        if exc.status_code == 404:
            why = NOT_SERVED.get(path)
            message = f"{request.method} {path} is not served here" + (f": {why}" if why else " (see GET /docs)")
        error = OpenAIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("gateway call failed")
        error = OpenAIError(500, f"the gateway failed: {type(exc).__name__}: {exc}", "internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Any:
        started = time.monotonic()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "other")
        if path != "/metrics":
            gateway.metrics.call(path, response.status_code, time.monotonic() - started)
        return response

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """200 only while a worker serves the namespace (as vLLM's `/health` answers only once its engine is up), so
        a client that waits for it can then call; until then, and once every worker's heartbeat expired, the 503
        `no_worker` that a call would get."""
        workers = gateway.serving(await gateway.live_workers())
        return {"status": "ok", "workers": len(workers)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await gateway.models()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(
        request: ChatRequest, x_session_id: str | None = Header(default=None)
    ) -> dict[str, Any] | StreamingResponse:
        answer = await gateway.chat(request, x_session_id)
        return _stream(answer, chat=True) if request.stream else answer

    @app.post("/v1/completions", response_model=None)
    async def completions(
        request: CompletionRequest, x_session_id: str | None = Header(default=None)
    ) -> dict[str, Any] | StreamingResponse:
        answer = await gateway.complete(request, x_session_id)
        return _stream(answer, chat=False) if request.stream else answer

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: FinishRequest | None = None) -> dict[str, Any]:
        return await gateway.finish(session_id, request or FinishRequest())

    add_vllm_routes(app, gateway)

    return app


def _stream(answer: dict[str, Any], chat: bool) -> StreamingResponse:
    """The whole answer as server-sent events: one chunk with the text, one with the finish reason, `[DONE]`."""

    def chunks() -> list[dict[str, Any]]:
        head = {k: answer[k] for k in ("id", "created", "model")}
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        out = []
        for choice in answer["choices"]:
            text = {"delta": dict(choice["message"])} if chat else {"text": choice["text"]}
            out.append(head | {"choices": [{"index": choice["index"], **text, "finish_reason": None}]})
            end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
            done = {"index": choice["index"], **end, "finish_reason": choice["finish_reason"]}
            out.append(head | {"choices": [done | {"spans": choice["spans"]}]})
        out.append(head | {"choices": [], "usage": answer["usage"]})
        return out

    async def events() -> AsyncIterator[str]:
        for chunk in chunks():
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
