"""``ServerEngine``: the :class:`rollout.engine.Engine` protocol over HTTP, against a
``rollstream serve`` server (``rollout.engine: server``) or a ``vllm serve`` server
(``rollout.engine: vllm``).

* **Prompts** are rendered here with the model's tokenizer and chat template (read from the
  rollout worker's model directory), exactly as :class:`~rollout.engine.TorchEngine` renders them;
  the server gets and returns token ids (``return_tokens_as_token_ids``), the chosen tokens'
  logprobs (``logprobs: 0``) and the finish reason; ``text`` is decoded here.
* **Sampling**: ``temperature`` (greedy = 0, logprobs at ``T = 1``; greedy at another temperature is
  refused), ``top_p``, ``max_tokens``, ``stop`` (the completing token kept, as in the torch engine).
  One HTTP call per request; the worker runs up to ``rollout.max_batch`` at once.
* **Behaviour logprobs** must be ``log_softmax(logits / T)``, untruncated (:mod:`rollout.sampling`):
  ``rollstream serve`` reports these; vLLM does with ``--logprobs-mode processed_logprobs`` and
  ``top_p = 1`` (unverified here: ``scripts/check_vllm_logprobs.py`` measures it on a GPU).
* **Versions and weights**: ``server`` reports each choice's versions and reloads with
  ``POST /v1/load_weights``; for ``vllm`` (unverified) the versions are this client's view, and a
  reload is dev-mode ``/collective_rpc`` (``update_config``, ``reload_weights``) then
  ``/reset_prefix_cache``.
* **Failures**: refused connections and 502/503/504 are retried with backoff (0.5 s doubling to
  8 s) for ``down_s`` seconds; then, like a timeout (``timeout_s``) or an error answer, the request
  completes with ``finish_reason="error"`` and a one-line ``error`` naming the server. Cancelling
  :meth:`generate` closes the HTTP requests of its unfinished completions.
"""

from __future__ import annotations

import asyncio
import json
import time
import typing
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import Any, Literal

import aiohttp

from rollout.engine import Completion, FinishReason, GenerationRequest
from rollout.model_init import encode_prompt, load_tokenizer, use_chat_template

RETRY_STATUS = (502, 503, 504)
"""HTTP statuses that mean "the server is not there right now": retried like a refused connection."""
BACKOFF_S = (0.5, 8.0)
"""First and largest wait between two tries at a server that is down, seconds."""
_FEED_DONE = object()  # end-of-stream marker on a generate() call's queue


class ServerDown(ConnectionError):
    """The server did not answer within ``down_s`` (refused connections, 502/503/504)."""


class ServerError(RuntimeError):
    """The server answered with an error (one line, naming the server)."""


def max_positions_of(model_dir: str | Path) -> int:
    """``max_position_embeddings`` of the model's ``config.json`` (a very large number if absent)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 1 << 30)


def parse_token_ids(tokens: list[str]) -> list[int]:
    """``["token_id:5", ...]`` (``return_tokens_as_token_ids``) -> ``[5, ...]``."""
    out = []
    for t in tokens:
        prefix, _, value = t.rpartition(":")
        if prefix != "token_id" or not value.lstrip("-").isdigit():
            raise ServerError(f"the server returned token {t!r}, not 'token_id:N' (return_tokens_as_token_ids)")
        out.append(int(value))
    return out


class ServerEngine:
    """Generation on a completions server (see the module doc)."""

    def __init__(
        self,
        model_dir: str | Path,
        url: str,
        *,
        flavor: Literal["server", "vllm"] = "server",
        timeout_s: float = 600.0,
        down_s: float = 120.0,
        policy_version: int = -1,
        chat_template: bool | str = "auto",
        system_prompt: str = "",
    ) -> None:
        self.url = url.rstrip("/")
        self.flavor = flavor
        self.timeout_s = timeout_s
        self.down_s = down_s
        self.tokenizer = load_tokenizer(model_dir)
        self.chat = use_chat_template(self.tokenizer, chat_template)
        """Whether prompts go through the tokenizer's chat template (``model.chat_template``)."""
        self.system_prompt = system_prompt
        self.max_positions = max_positions_of(model_dir)
        self.policy_version = policy_version
        """The version of this client's last :meth:`load_weights` (what the server holds, unless
        another client of the same server reloaded it since)."""
        self.model_name = ""
        """The server's model name (``/v1/models``), asked once."""
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ----------------------------------------------------------------- protocol

    def encode(self, prompt: str, system_prompt: str | None = None) -> list[int]:
        """Prompt token ids (:func:`rollout.model_init.encode_prompt`), as the torch engine renders them."""
        system = self.system_prompt if system_prompt is None else system_prompt
        return encode_prompt(self.tokenizer, prompt, chat=self.chat, system_prompt=system)

    async def generate(
        self, requests: Iterable[GenerationRequest] | AsyncIterable[GenerationRequest]
    ) -> AsyncIterator[Completion]:
        """Send every request (one HTTP call each, all at once; a stream's requests as they come)
        and yield completions in the order they finish. Invalid requests raise ``ValueError`` (for a
        list, before anything is sent; for a stream, after the completions of those before it).
        Closing the iterator early cancels the calls still running."""
        out: asyncio.Queue[Completion | object] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        submitted = 0

        async def one(req: GenerationRequest) -> None:
            out.put_nowait(await self._complete(req))

        def submit(req: GenerationRequest) -> None:
            nonlocal submitted
            self._validate(req)
            tasks.add(asyncio.ensure_future(one(req)))
            submitted += 1

        async def feed(stream: AsyncIterable[GenerationRequest]) -> None:
            try:
                async for req in stream:
                    submit(req)
            finally:
                out.put_nowait(_FEED_DONE)

        feeder: asyncio.Task[None] | None = None
        try:
            if isinstance(requests, AsyncIterable):
                feeder = asyncio.ensure_future(feed(requests))
                feeding = True
            else:
                batch = list(requests)
                for req in batch:
                    self._validate(req)
                for req in batch:
                    submit(req)
                feeding = False
            delivered = 0
            while feeding or delivered < submitted:
                item = await out.get()
                if item is _FEED_DONE:
                    feeding = False
                    continue
                delivered += 1
                yield typing.cast(Completion, item)
            if feeder is not None:
                await feeder  # re-raises a bad request or a failing stream
        finally:
            pending = [t for t in (*tasks, feeder) if t is not None and not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def load_weights(self, ref: str | Path, version: int | None = None) -> None:
        """Have the server load the published weights directory ``ref`` (it must see the same path)
        and record ``version`` (None = current + 1). Raises :class:`ServerDown` / :class:`ServerError`
        (one line) when it cannot."""
        path = str(Path(ref).resolve())
        new = self.policy_version + 1 if version is None else version
        if self.flavor == "server":
            await self._call("POST", "/v1/load_weights", {"path": path, "version": new})
        else:  # vLLM (unverified here): reload from the directory through the dev-mode RPC endpoint
            await self._call("POST", "/collective_rpc",
                             {"method": "update_config", "args": [{"model_config": {"model": path}}]})
            await self._call("POST", "/collective_rpc", {"method": "reload_weights"})
            await self._call("POST", "/reset_prefix_cache", None)
        self.policy_version = new

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # ----------------------------------------------------------------- requests

    def _validate(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if len(req.prompt_ids) >= self.max_positions:
            raise ValueError(f"request {req.request_id}: prompt of {len(req.prompt_ids)} tokens leaves no room "
                             f"(model max_position_embeddings={self.max_positions})")
        if req.params.greedy and req.params.temperature != 1.0:
            raise ValueError(f"request {req.request_id}: greedy at temperature {req.params.temperature} cannot be "
                             "asked of a completions server (greedy is temperature 0, logprobs at T=1)")

    def _body(self, req: GenerationRequest) -> dict[str, Any]:
        p = req.params
        cap = min(p.max_new_tokens, self.max_positions - len(req.prompt_ids))
        body: dict[str, Any] = {
            "model": self.model_name, "prompt": list(req.prompt_ids), "max_tokens": cap,
            "temperature": 0.0 if p.greedy else p.temperature, "top_p": p.top_p, "n": 1, "logprobs": 0,
            "return_tokens_as_token_ids": True}
        if p.stop:
            body["stop"] = list(p.stop)
            body["include_stop_str_in_output"] = True
        return body

    async def _complete(self, req: GenerationRequest) -> Completion:
        """One request as a :class:`Completion`; failures become ``finish_reason="error"``."""
        submitted = time.perf_counter()
        version = self.policy_version
        try:
            if not self.model_name:
                models = await self._call("GET", "/v1/models", None)
                self.model_name = str(models["data"][0]["id"])
            reply = await self._call("POST", "/v1/completions", self._body(req))
            choice = reply["choices"][0]
            tokens = parse_token_ids(choice["logprobs"]["tokens"])
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            if len(logprobs) != len(tokens):
                raise ServerError(f"{self.url} returned {len(tokens)} tokens but {len(logprobs)} logprobs")
            reason = choice.get("finish_reason")
            finish: FinishReason = reason if reason in ("stop", "length", "abort") else "error"
            error = "" if finish != "error" else f"{self.url} finished with {reason!r}"
            start_v = int(choice.get("policy_version", version))
            end_v = int(choice.get("policy_version_end", self.policy_version))
        except asyncio.CancelledError:
            raise
        except (ServerError, ServerDown, KeyError, IndexError, TypeError, ValueError) as e:
            return self._failed(req, submitted, version, str(e) if isinstance(e, (ServerError, ServerDown))
                                else f"{self.url} returned an unexpected answer ({type(e).__name__}: {e})")
        return Completion(
            request_id=req.request_id, prompt_ids=list(req.prompt_ids), token_ids=tokens, logprobs=logprobs,
            text=str(self.tokenizer.decode(tokens, skip_special_tokens=True)), finish_reason=finish,
            policy_version=start_v, policy_version_end=end_v, queued_s=0.0,
            gen_s=time.perf_counter() - submitted, error=error)

    def _failed(self, req: GenerationRequest, submitted: float, version: int, error: str) -> Completion:
        return Completion(
            request_id=req.request_id, prompt_ids=list(req.prompt_ids), token_ids=[], logprobs=[], text="",
            finish_reason="error", policy_version=version, policy_version_end=self.policy_version,
            gen_s=time.perf_counter() - submitted, error=" ".join(error.split()))

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # no connection cap of its own: the rollout worker's concurrency (rollout.max_batch) is the bound
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  connector=aiohttp.TCPConnector(limit=0))
            self._loop = loop
        return self._session

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        """One JSON call, retried with backoff while the server is down (``down_s``)."""
        url = f"{self.url}{path}"
        deadline = time.monotonic() + self.down_s
        wait = BACKOFF_S[0]
        while True:
            try:
                async with self._client().request(method, url, json=body) as resp:
                    if resp.status not in RETRY_STATUS:
                        text = await resp.text()
                        if resp.status >= 400:
                            raise ServerError(f"{url} answered {resp.status}: {_message(text)}")
                        return json.loads(text) if text.strip() else {}
                    why = f"HTTP {resp.status}"
            except aiohttp.ClientConnectionError as e:  # refused, reset, closed mid-answer
                if isinstance(e, aiohttp.ServerTimeoutError):
                    raise ServerError(f"{url} did not answer within {self.timeout_s:g}s") from None
                why = f"{type(e).__name__}: {e}"
            except TimeoutError:
                raise ServerError(f"{url} did not answer within {self.timeout_s:g}s "
                                  "(rollout.server_timeout_s)") from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServerDown(f"generation server {self.url} unreachable for {self.down_s:g}s "
                                 f"(rollout.server_down_s): {why}; is it running?")
            await asyncio.sleep(min(wait, remaining))
            wait = min(wait * 2, BACKOFF_S[1])


def _message(text: str) -> str:
    """The ``message`` of an OpenAI-style error body (else the text), on one line."""
    try:
        data = json.loads(text)
        msg = data.get("message") or data.get("error", {}).get("message") or text
    except (ValueError, AttributeError):
        msg = text
    return " ".join(str(msg).split())[:500]
