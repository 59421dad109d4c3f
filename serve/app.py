"""`Ingress`: the FastAPI app behind Ray Serve's HTTP proxy — vLLM's OpenAI routes, guarded, in front of the engines.

    POST /v1/completions        prompt: text, token ids, or a list of either -> one engine prompt each
    POST /v1/chat/completions   messages -> the chat template (on the engine replica) -> one engine prompt
    GET  /v1/models             the served model
    GET  /metrics               Prometheus text (serve.metrics)
    GET  /health                200 while serving (an engine replica answered), 503 while starting or draining;
                                the only route without the API key

Every route but /health checks `Authorization: Bearer <key>` (hmac.compare_digest) when a key is set; bodies are read
up to --max-body-bytes; bad JSON or wrong types give 400 naming the field (serve.protocol); a full queue (Ray Serve's
max_queued_requests on the engine handle raises BackPressureError) gives 503 with Retry-After; a replica lost
mid-request gives 503. A request answers only once every file it names is durable; one that fails answers nothing
and leaves no file (the other prompts' files of a failed list request are removed). `drain()` (called on SIGTERM by
serve.server) refuses new requests and waits for those in flight.

With --speculative-config the replicas decode speculatively and write nothing: no file is owned or discarded,
kv_transfer_params get 400, and /metrics adds vLLM's vllm:spec_decode_* counters (serve.metrics).
"""

# no `from __future__ import annotations`: Serve rebuilds the route signatures and needs real annotations
import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from connectors import storage
from connectors.paths import PathInUse, PathOwners, PathRejected
from serve.config import ServeConfig
from serve.engine import EngineReply, PromptRequest
from serve.metrics import ServeMetrics
from serve.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    chat_response,
    completion_response,
    models_response,
    parse_body,
)

logger = logging.getLogger(__name__)

app = FastAPI(title="hsx serve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods, as OpenAI error objects."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if exc.status_code == 404:
        message += "; routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /metrics, /health"
    err = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else "method_not_allowed")
    return JSONResponse(err.body(), status_code=exc.status_code)


@serve.ingress(app)
class Ingress:
    """A Serve deployment class (wrapped by serve.deployment in serve.server); `engine` is the Engine handle."""

    def __init__(self, engine, config: ServeConfig) -> None:
        self.engine = engine
        self.config = config
        spec = config.speculative
        self.metrics = ServeMetrics(spec.num_speculative_tokens if spec else 0, config.model_name)
        self._key = config.api_key.encode() if config.api_key else None
        self._in_flight = 0
        self._draining = False
        self._info: dict[str, Any] | None = None

        # who owns each custom path, across replicas: each replica's connector knows only its own requests
        self._policy = config.path_policy()
        self._owners = PathOwners()

    # -- routes ---------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """200 once an engine replica has answered (so the first real request does not wait for the handle to
        learn its replicas), 503 while starting or draining."""
        if self._draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self._info is None:
            try:
                self._info = await asyncio.wait_for(self.engine.info.remote(), timeout=10)
            except Exception as e:  # no replica yet, or it is still loading its model
                return JSONResponse({"status": "starting", "detail": f"{type(e).__name__}: {e}"[:300]},
                                    status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._serve(request, "models", self._models)

    @app.get("/metrics")
    async def metrics_text(self, request: Request) -> Response:
        async def text(_: Request) -> Response:
            return Response(self.metrics.text(), media_type=self.metrics.content_type)

        return await self._serve(request, "metrics", text)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions", self._completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat", self._chat)

    # -- lifecycle (called through the app's handle) ---------------------------------------------------------------
    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503), wait up to timeout_s for those in flight; returns how many are still running."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._in_flight

    # -- guard ----------------------------------------------------------------------------------------------------
    async def _serve(self, request: Request, endpoint: str, handler: Callable[[Request], Awaitable[Response]]
                     ) -> Response:
        start = time.perf_counter()
        status = 500
        try:
            self._authorize(request)
            if self._draining:
                raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                               headers={"Retry-After": str(self.config.retry_after_s)})
            self._in_flight += 1
            try:
                response = await handler(request)
            finally:
                self._in_flight -= 1
            status = response.status_code
            return response
        except APIError as e:
            status = e.status
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except asyncio.CancelledError:
            status = 499  # the client went away; the engine removes what it wrote for it
            raise
        except ClientDisconnect:  # gone while still sending its body: nothing ran
            status = 499
            return Response(status_code=499)
        except Exception as e:
            logger.exception("%s failed", endpoint)
            err = APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
            return JSONResponse(err.body(), status_code=500)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if endpoint in ("completions", "chat") and status == 200:
                self.metrics.request_seconds.observe(time.perf_counter() - start)

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "key the server was started with (--api-key / $HSX_API_KEY)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _read(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = APIError(400, f"the request body is larger than the limit of {limit} bytes (--max-body-bytes); send "
                                "fewer or shorter prompts per request", code="body_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    # -- handlers -------------------------------------------------------------------------------------------------
    async def _models(self, _: Request) -> Response:
        if self._info is None:
            self._info = await self.engine.info.remote()
        return JSONResponse(models_response(self.config.model_name, self._info["max_model_len"]))

    async def _completions(self, request: Request) -> Response:
        body: CompletionBody = parse_body(CompletionBody, await self._read(request))
        self._check_model(body.model)
        prompts = body.prompts()
        if len(prompts) > self.config.max_prompts_per_request:
            raise APIError(400, f"{len(prompts)} prompts in one request, more than the limit of "
                                f"{self.config.max_prompts_per_request} (--max-prompts-per-request)", param="prompt",
                           code="too_many_prompts")
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"  # not 32 hex: the file keeps the id as its name
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        kv, files = self._kv_params(body)
        if len(prompts) > 1 and kv.get("hidden_states_path"):
            raise APIError(400, "kv_transfer_params.hidden_states_path names one file, but the request has "
                                f"{len(prompts)} prompts; send one prompt per request with a custom path",
                           param="kv_transfer_params.hidden_states_path", code="invalid_value")
        requests = [PromptRequest(i, **({"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}),
                                  max_tokens=body.max_tokens, **body.sampling(), kv_transfer_params=kv, files=files)
                    for i, p in zip(ids, prompts)]
        replies = await self._owning(kv, ids, self._extract(requests), files)
        return JSONResponse(completion_response(rid, self.config.model_name, replies, body.return_token_ids))

    async def _chat(self, request: Request) -> Response:
        body: ChatBody = parse_body(ChatBody, await self._read(request))
        self._check_model(body.model)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        kv, files = self._kv_params(body)
        req = PromptRequest(rid, messages=[m.template_dict() for m in body.messages],
                            add_generation_prompt=body.add_generation_prompt,
                            continue_final_message=body.continue_final_message, chat_template=body.chat_template,
                            chat_template_kwargs=body.chat_template_kwargs, max_tokens=body.token_limit,
                            **body.sampling(), kv_transfer_params=kv, files=files)
        (reply,) = await self._owning(kv, [rid], self._extract([req]), files)
        return JSONResponse(chat_response(rid, self.config.model_name, reply, body.return_token_ids))

    def _kv_params(self, body) -> tuple[dict[str, Any], bool]:
        """The request's kv_transfer_params and whether it writes a file (every request does, unless the server runs
        --no-files: then those that send kv_transfer_params). 400 for kv_transfer_params on a server that writes no
        files (speculative, or --no-files without --output)."""
        sent = body.kv_transfer_params is not None
        kv = body.kv_transfer_params.model_dump(exclude_none=True) if sent else {}
        spec = self.config.speculative
        if sent and spec is not None:
            raise APIError(400, f"kv_transfer_params on a server that decodes speculatively (--speculative-config "
                                f"method {spec.method!r}) and writes no hidden states; leave them out, or send the "
                                "request to an hsx serve started without --speculative-config",
                           param="kv_transfer_params", code="invalid_value")
        if sent and not self.config.writes_files:
            raise APIError(400, "kv_transfer_params on a server that only generates (--no-files without --output) "
                                "and writes no hidden states; leave them out, or start hsx serve with --output",
                           param="kv_transfer_params", code="invalid_value")
        return kv, self.config.writes_files and (sent or self.config.files)

    async def _owning(self, kv: dict[str, Any], ids: list[str], work: Awaitable[list[EngineReply]],
                      files: bool = True) -> list[EngineReply]:
        """Run `work` owning the files it writes (connectors.paths.PathOwners, as each connector does, but for every
        replica at once): its default-named files (one per prompt id) while it runs, or its custom path. A custom
        path another request is writing, wrote without overwrite, or that exists already (another request's
        default-named file, a file from before) is 409 unless kv says overwrite."""
        if not files:  # it writes none (a speculative server, --no-files): nothing to own
            return await work
        custom, overwrite = kv.get("hidden_states_path"), bool(kv.get("overwrite"))
        if custom is None:
            dests = [(self._policy.default_destination(i), i) for i in ids]
        else:  # located here once: a refused path is answered before anything is queued or tokenized
            try:
                dests = [(self._policy.locate(custom), ids[0])]
            except PathRejected as e:
                work.close()
                raise APIError(403, f"{e}; nothing was written", param="kv_transfer_params.hidden_states_path",
                               code="path_not_allowed") from None
        claimed = []
        try:
            for dest, owner in dests:
                self._owners.claim(dest, owner, overwrite)
                claimed.append((dest, owner))
            if custom is not None and not overwrite:
                dest = dests[0][0]
                fs, path = storage.open_url(dest.path, self.config.storage_options)
                try:
                    exists = await asyncio.to_thread(fs.exists, path)
                except OSError:  # the store cannot say now: the write itself will (a 5xx there, nothing lost)
                    exists = False
                if exists:
                    raise PathInUse(f"request {ids[0]!r}: {dest.path} exists already (another request's file, "
                                    "or one from before); refusing to overwrite it silently. Pass "
                                    "kv_transfer_params['overwrite'] = True to replace it, or choose another "
                                    "hidden_states_path")
        except PathInUse as e:
            work.close()
            for dest, owner in claimed:
                self._owners.release(dest, owner, committed=False)
            raise APIError(409, str(e), param="kv_transfer_params.hidden_states_path", code="path_in_use") from None
        written = False
        try:
            replies = await work
            written = True
            return replies
        finally:
            for dest, owner in claimed:
                self._owners.release(dest, owner, committed=written and custom is not None and not overwrite)

    async def _extract(self, requests: list[PromptRequest]) -> list[EngineReply]:
        """Every prompt through the engine replicas; all succeed or the request fails and keeps no file."""
        self.metrics.queue_depth.inc(len(requests))
        tasks = [asyncio.ensure_future(self._one(r)) for r in requests]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away: the prompts still running are cancelled with it,
            for t in tasks:             # and those that had finished keep no file either
                if t.done() and not t.cancelled() and t.exception() is None and t.result().ok:
                    self._discard(t.result().path, "client_gone")  # (a failed prompt's error is not re-raised)
            raise
        finally:
            self.metrics.queue_depth.dec(len(requests))
        failure = next((r for r in results if not isinstance(r, EngineReply)), None)
        if failure is None:
            failure = next((APIError(r.status, r.message, param=r.param, code=r.code) for r in results if not r.ok),
                           None)
        for r in results:  # tokens and bytes count only for an answered request
            if isinstance(r, EngineReply):
                self.metrics.observe_reply(r, answered=failure is None)
        if failure is None:
            return results
        for r in results:  # all or nothing: the other prompts' files go
            if isinstance(r, EngineReply) and r.ok:
                self._discard(r.path)
        raise failure  # an APIError, or anything else: _serve answers 500

    async def _one(self, request: PromptRequest) -> EngineReply:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        retry = {"Retry-After": str(self.config.retry_after_s)}
        try:
            return await self.engine.extract.remote(request)
        except BackPressureError:
            raise APIError(503, f"the server is at capacity ({self.config.max_queued_requests} prompts queued, "
                                "--max-queued-requests); retry after a moment", code="queue_full",
                           headers=retry) from None
        except (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError) as e:
            logger.warning("request %s: engine replica lost: %s", request.request_id, e)
            raise APIError(503, "the engine replica serving this request was lost before the file was durable; "
                                "nothing was acknowledged, retry the request", code="replica_lost",
                           headers=retry) from None

    def _discard(self, path: str | None, reason: str = "request_failed") -> None:
        from connectors import cleanup_hidden_states  # torch: the ingress loads it only to discard a file

        if path is None:
            return
        try:
            cleanup_hidden_states(path, storage_options=self.config.storage_options)
            self.metrics.files_discarded.labels(reason).inc()
        except OSError as e:
            logger.warning("could not remove %s of a failed request: %s", path, e)

