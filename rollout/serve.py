"""``rollstream serve MODEL_DIR``: a checkpoint behind an OpenAI-style completions API.

One :class:`rollout.engine.TorchEngine` (continuous batching: concurrent requests share its decode
steps) behind an aiohttp server. It speaks the subset of vLLM's ``/v1/completions`` dialect that the
rollout client (:class:`rollout.server_engine.ServerEngine`) uses, so ``rollout.engine: server``
and ``rollout.engine: vllm`` share one client. Endpoints:

* ``POST /v1/completions``: token-id or text prompts, ``max_tokens``, ``temperature`` (0 =
  greedy), ``top_p``, ``n``, ``stop``, ``include_stop_str_in_output``, ``logprobs`` (null or 0),
  ``return_tokens_as_token_ids``, ``model``; ``seed``, ``stream``, ``echo`` and any other field are
  refused (400, one line). Each choice also carries ``token_ids``, ``policy_version`` and
  ``policy_version_end``; logprobs are ``log_softmax(logits / T)`` of the chosen token,
  untruncated by ``top_p`` (:mod:`rollout.sampling`).
* ``POST /v1/load_weights`` ``{"path": DIR, "version": N}``: hot swap between two engine steps
  (version omitted = current + 1; the path and version already loaded: nothing to do).
* ``GET /v1/models``, ``GET /health`` (``{"status": "ok", "policy_version": N}``).

A cancelled request stops being waited on (its sequences run on inside the engine, which has no
abort). SIGTERM / SIGINT stop accepting connections and let requests in flight finish (up to
``shutdown_grace_s``). Every field and default: docs/architecture.md, "Engines and strategies".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from rollout.engine import Completion, GenerationRequest, TorchEngine
from rollout.sampling import SamplingParams
from schemas.config import ConfigError, resolve_dtype
from schemas.errors import one_line, to_thread

log = logging.getLogger("rollstream.serve")

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ServeSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of ``rollstream serve``."""

    model_dir: str
    """The model to serve (Hugging Face directory with safetensors weights and a tokenizer)."""
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` = every interface)."""
    port: int = 8000
    """TCP port to listen on; 0 = a free port (the ``serving`` line names it)."""
    device: str = "auto"
    """Torch device: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """Parameter dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32``, ``bfloat16``, ``float16``."""
    max_batch: int = 64
    """Sequences decoded together (the engine's continuous-batching slots); more wait for a slot."""
    seed: int = 0
    """Seed of the engine's one sampling generator (per-request seeds are refused)."""
    served_model_name: str = ""
    """Model name in ``/v1/models`` and responses (a request's ``model`` must be it or empty);
    empty = the model directory's name."""
    policy_version: int = 0
    """Weights version reported until the first ``/v1/load_weights``."""
    max_request_sequences: int = 1024
    """Prompts × ``n`` of one request at most (a larger request is refused with 400)."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM/SIGINT: how long requests in flight may still finish, seconds."""
    cuda_graphs: bool = True
    """On a CUDA device with a Llama-family model: replay each decode step as a CUDA graph
    (:mod:`rollout.slot_decoder`); ``False`` runs the steps eagerly. No effect on the CPU."""


def check_settings(s: ServeSettings) -> None:
    """:class:`ConfigError` (one line naming the option) for a value that cannot be served."""
    if not (Path(s.model_dir) / "config.json").is_file():
        raise ConfigError(f"serve: {s.model_dir} is not a model directory (no config.json); "
                          "create one with `rollstream init-model DIR` or give a Hugging Face model directory")
    if not 0 <= s.port <= 65535:
        raise ConfigError(f"serve: --port={s.port} is not a TCP port; use 0..65535 (0 = any free port)")
    if s.dtype not in DTYPES:
        raise ConfigError(f"serve: --dtype={s.dtype!r} is not one of {', '.join(DTYPES)}")
    for name, value in (("--max-batch", s.max_batch), ("max_request_sequences", s.max_request_sequences)):
        if value < 1:
            raise ConfigError(f"serve: {name}={value} must be >= 1")
    if s.shutdown_grace_s < 0:
        raise ConfigError(f"serve: shutdown_grace_s={s.shutdown_grace_s} must be >= 0")


class CompletionBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The accepted fields of ``POST /v1/completions`` (see the module doc)."""

    prompt: Any
    model: str = ""
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    stream: bool = False
    echo: bool = False


class LoadBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/load_weights``."""

    path: str
    version: int | None = None


class BadRequest(ValueError):
    """A request the server refuses (400, one line)."""


class Server:
    """The engine and the HTTP handlers."""

    def __init__(self, settings: ServeSettings, engine: TorchEngine) -> None:
        self.s = settings
        self.engine = engine
        self.name = settings.served_model_name or Path(settings.model_dir).resolve().name
        self.vocab_size = len(engine.tokenizer)
        self.loaded: tuple[str, int] | None = None  # (path, version) of the last reload
        self._reload_lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/load_weights", self.load_weights),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
        ])
        return app

    # ----------------------------------------------------------------- handlers

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "policy_version": self.engine.policy_version})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.name, "object": "model", "owned_by": "rollstream", "root": str(self.s.model_dir),
            "max_model_len": self.engine.max_positions, "policy_version": self.engine.policy_version}]})

    async def load_weights(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=LoadBody)
        except msgspec.ValidationError as e:
            return error(400, f"load_weights: {e}")
        except msgspec.DecodeError as e:
            return error(400, f"load_weights: the body is not JSON ({e})")
        async with self._reload_lock:
            if body.version is not None and self.loaded == (body.path, body.version) \
                    and self.engine.policy_version == body.version:
                return web.json_response({"policy_version": body.version, "reloaded": False})
            t0 = time.perf_counter()
            try:
                await self.engine.load_weights(body.path, body.version)
            except (OSError, KeyError, RuntimeError, ValueError) as e:
                return error(400, f"load_weights: cannot load {body.path}: {one_line(e)}")
            self.loaded = (body.path, self.engine.policy_version)
        log.info("loaded weights v%d from %s in %.2fs", self.engine.policy_version, body.path,
                 time.perf_counter() - t0)
        return web.json_response({"policy_version": self.engine.policy_version, "reloaded": True})

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=CompletionBody)
            prompts, params = self.parse(body)
        except msgspec.ValidationError as e:
            return error(400, f"completions: {e}")
        except msgspec.DecodeError as e:
            return error(400, f"completions: the body is not JSON ({e})")
        except BadRequest as e:
            return error(400, f"completions: {e}")
        except LookupError as e:
            return error(404, f"completions: {e}")
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = [GenerationRequest(f"{rid}-{i}-{j}", p, params) for i, p in enumerate(prompts) for j in range(body.n)]
        done = {c.request_id: c async for c in self.engine.generate(reqs)}
        ordered = [done[r.request_id] for r in reqs]
        failed = next((c for c in ordered if c.finish_reason == "error"), None)
        if failed is not None:
            return error(500, f"completions: the engine failed: {failed.error}")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        choices = [self.choice(i, c, body, stops) for i, c in enumerate(ordered)]
        n_prompt = sum(len(p) for p in prompts) * body.n
        n_out = sum(len(c.token_ids) for c in ordered)
        return web.json_response({
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": self.name,
            "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}})

    # ----------------------------------------------------------------- request parsing

    def parse(self, body: CompletionBody) -> tuple[list[list[int]], SamplingParams]:
        """The prompts (token ids) and sampling parameters of a request; :class:`BadRequest` names
        the field that cannot be honoured."""
        if body.model and body.model != self.name:
            raise LookupError(f"model {body.model!r} is not served here; /v1/models lists {self.name!r}")
        for name, value, default in (("seed", body.seed, None), ("stream", body.stream, False),
                                     ("echo", body.echo, False)):
            if value != default:
                why = ("sampling draws from the server's one generator (rollstream serve --seed)"
                       if name == "seed" else "not supported by rollstream serve")
                raise BadRequest(f"{name}={value!r} is refused: {why}; leave it out")
        if body.logprobs not in (None, 0):
            raise BadRequest(f"logprobs={body.logprobs} is refused: only the chosen token's logprob is "
                             "computed; use logprobs=0")
        if body.n < 1:
            raise BadRequest(f"n={body.n} must be >= 1")
        if body.max_tokens is not None and body.max_tokens < 1:
            raise BadRequest(f"max_tokens={body.max_tokens} must be >= 1")
        if body.temperature < 0:
            raise BadRequest(f"temperature={body.temperature} must be >= 0 (0 = greedy)")
        if not 0 < body.top_p <= 1:
            raise BadRequest(f"top_p={body.top_p} must be in (0, 1]")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if any(not s for s in stop):
            raise BadRequest("stop has an empty string; give non-empty stop strings")
        prompts = self.prompts(body.prompt)
        if len(prompts) * body.n > self.s.max_request_sequences:
            raise BadRequest(f"{len(prompts)} prompt(s) × n={body.n} exceeds max_request_sequences="
                             f"{self.s.max_request_sequences}; split the request")
        greedy = body.temperature == 0
        cap = self.engine.max_positions if body.max_tokens is None else body.max_tokens  # None: up to the context
        params = SamplingParams(max_new_tokens=cap, temperature=1.0 if greedy else body.temperature,
                                top_p=body.top_p, greedy=greedy, stop=stop)
        return prompts, params

    def prompts(self, prompt: Any) -> list[list[int]]:
        """``prompt`` as a list of token-id lists, each checked against the vocabulary and context."""
        if isinstance(prompt, str):
            raw: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            raw = [prompt]
        elif isinstance(prompt, list) and prompt:
            raw = prompt
        else:
            raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either")
        out = []
        for i, p in enumerate(raw):
            if isinstance(p, str):
                p = list(self.engine.tokenizer(p).input_ids)
            if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise BadRequest(f"prompt[{i}] is neither a string nor a list of token ids")
            if not p:
                raise BadRequest(f"prompt[{i}] is empty")
            bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"prompt[{i}] has token id {bad}, outside the vocabulary (0..{self.vocab_size - 1})")
            if len(p) >= self.engine.max_positions:
                raise BadRequest(f"prompt[{i}] has {len(p)} tokens; this model's maximum context length is "
                                 f"{self.engine.max_positions} tokens, with room for at least one generated")
            out.append(p)
        return out

    # ----------------------------------------------------------------- response

    def choice(self, index: int, c: Completion, body: CompletionBody, stops: list[str]) -> dict[str, Any]:
        """One ``choices`` entry in vLLM's completions shape, plus ``token_ids`` and the versions."""
        tok = self.engine.tokenizer
        text = c.text
        stop_reason: str | None = None  # the stop string that ended it (None: EOS, length)
        if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] not in self.engine.eos_ids:
            hit = [(text.find(s), s) for s in stops if s in text]
            if hit:
                at, stop_reason = min(hit)
                if not body.include_stop_str_in_output:
                    text = text[:at]
        logprobs = None
        if body.logprobs is not None:
            pieces = [str(tok.decode([t])) for t in c.token_ids]
            offsets, at = [], 0
            for piece in pieces:
                offsets.append(at)
                at += len(piece)
            logprobs = {
                "tokens": [f"token_id:{t}" for t in c.token_ids] if body.return_tokens_as_token_ids else pieces,
                "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": offsets}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": stop_reason, "token_ids": c.token_ids, "policy_version": c.policy_version,
                "policy_version_end": c.policy_version_end}


def error(status: int, message: str) -> web.Response:
    """An error in the OpenAI shape with a one-line message."""
    line = " ".join(message.split())
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return web.json_response({"object": "error", "message": line, "type": kind, "code": status}, status=status)


async def run(settings: ServeSettings, stop: asyncio.Event | None = None,
              ready: asyncio.Future[str] | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop``). Prints ``serving NAME at http://HOST:PORT`` once
    listening; ``ready`` (when given) gets that URL."""
    from schemas.devices import resolve_device

    check_settings(settings)
    device = resolve_device(settings.device, "--device")
    dtype = resolve_dtype(settings.dtype, device)
    engine = await to_thread(
        TorchEngine, settings.model_dir, max_batch=settings.max_batch, device=device, dtype=dtype,
        seed=settings.seed, policy_version=settings.policy_version, chat_template=False,
        cuda_graphs=settings.cuda_graphs)
    server = Server(settings, engine)
    runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=settings.shutdown_grace_s,
                           access_log=log)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"serve: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}; "
                          "choose another --port or --host") from None
    port = runner.addresses[0][1] if runner.addresses else settings.port
    url = f"http://{settings.host}:{port}"
    print(f"serving {server.name} at {url} ({device}, {dtype}, max batch {settings.max_batch}, "
          f"policy version {engine.policy_version})", flush=True)
    log.info("serving %s from %s at %s on %s (%s)", server.name, settings.model_dir, url, device, dtype)
    if ready is not None and not ready.done():
        ready.set_result(url)
    stopping = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stopping.set)
            installed.append(sig)
    try:
        await stopping.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        log.info("stopping: finishing requests in flight (up to %gs)", settings.shutdown_grace_s)
        await runner.cleanup()
