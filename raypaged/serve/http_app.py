"""The HTTP surface: routes, API key, body limit, and OpenAI-shaped errors for everything.

/health and /metrics stay open when an API key is set; every other route needs
`Authorization: Bearer KEY`. No request, however malformed, gets a 500 from the checks here.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Callable

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from raypaged.serve.api_key import check_api_key
from raypaged.serve.client_gate import CLIENT, client_of
from raypaged.serve.errors import APIError, bad_request
from raypaged.serve.fleet import FleetSnapshot
from raypaged.serve.frontend import OpenAIFrontend
from raypaged.serve.body_parser import BodyParsers, model_fields
from raypaged.serve.json_body import check_content_type
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest

logger = logging.getLogger(__name__)

LARGE_BODY_BYTES = 256 * 1024


def build_http_app(frontend: OpenAIFrontend, snapshot: Callable[[], FleetSnapshot],
                   metrics: RequestMetrics, render_metrics: Callable[[], bytes],
                   api_key: str | None, max_request_bytes: int,
                   body_timeout_s: float | None = None) -> FastAPI:
    check_api_key(api_key, "api_key")  # None: no auth; "" is a mistake, not a wish
    app = FastAPI(title="raypaged", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(DisconnectAsMessage)
    large_bodies = BodyParsers(LARGE_BODY_BYTES)  # parsed in child processes

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_json(request: Request, precheck=None, fields=None):
        check_content_type(request.headers.get("content-type"))
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request("invalid Content-Length header")
            if int(declared) > max_request_bytes:
                raise _too_large(max_request_bytes)
        body = bytearray()
        # A client that sends its body slowly (or never) holds one of the replica's request
        # slots for as long as it is read: give up after body_timeout_s with 408, and the
        # server closes the connection (its unread body cannot be skipped).
        timeout = asyncio.timeout(body_timeout_s)
        try:
            async with timeout:
                async for piece in request.stream():
                    body += piece
                    if len(body) > max_request_bytes:
                        raise _too_large(max_request_bytes)
        except TimeoutError:
            if not timeout.expired():
                raise
            raise APIError(408, f"the request body was not received within {body_timeout_s:g} "
                                "s: send it at once (the limit is the setting body_timeout_s, "
                                "--body-timeout-s)", code="body_timeout",
                           headers={"Connection": "close"}) from None
        return await large_bodies.parse(bytes(body), precheck, fields)

    def answering(handler, model=None):
        """The route that runs `handler` on the request's body. `model`: its request model,
        whose limits and fields the child that parses a large body applies (body_parser.py: a
        refused body's value never reaches this process)."""
        precheck = () if model is None else (frontend.body_checks[model], model_fields(model))

        async def answer(request: Request):
            try:
                authorize(request)
                client = client_of(request.scope)
                CLIENT.set(client)  # each Generation started below takes its ticket as this client
                frontend.dispatcher.gate.check(client)  # at its cap: 429 before the body is read
                return await handler(await read_json(request, *precheck))
            except APIError as exc:
                metrics.inc("request_errors", str(exc.status))
                return exc.response()
        return answer

    app.post("/v1/completions")(answering(frontend.completions, CompletionRequest))
    app.post("/v1/chat/completions")(answering(frontend.chat_completions, ChatCompletionRequest))
    # vLLM's: a prompt's or a conversation's token ids
    app.post("/tokenize")(answering(frontend.tokenize))
    app.post("/detokenize")(answering(frontend.detokenize, DetokenizeRequest))

    def keyed_json(view):
        """A read-only JSON route behind the API key: `view` called with the path's
        parameters."""
        async def answer(request: Request):
            try:
                authorize(request)
                return JSONResponse(view(**request.path_params))
            except APIError as exc:
                return exc.response()
        return answer

    app.get("/v1/models")(keyed_json(frontend.models))
    # :path: a model named org/name has a slash
    app.get("/v1/models/{model_id:path}")(keyed_json(frontend.model))
    # the controller's fleet view as JSON: per worker and in total
    app.get("/fleet")(keyed_json(lambda: snapshot().to_json()))

    @app.get("/health")
    async def health():
        ready = len(snapshot().ready())
        if not ready:
            return APIError(503, "no worker is ready", code="no_workers", retry_after=1).response()
        return JSONResponse({"status": "ok", "workers_ready": ready})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}
        return APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                        headers=exc.headers).response()  # a 405's Allow: what the route takes

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        metrics.inc("request_errors", "500")
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    return app


class DisconnectAsMessage:
    """Serve's proxy cancels the task that feeds `receive` when a client leaves mid-stream, and
    `receive` then raises TaskCancelledError in the response's disconnect listener. ASGI says
    a departed client is an `http.disconnect` message: pass it on as one, so the request ends
    as an abort (counted by its own accounting) instead of an unhandled error with a traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
