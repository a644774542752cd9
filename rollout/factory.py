"""``make_engine(cfg)``: the only place that picks a generation backend (``rollout.engine``).

* ``torch``: :class:`rollout.engine.TorchEngine` in this process.
* ``server``: :class:`rollout.server_engine.ServerEngine` against a ``rollstream serve`` server.
* ``vllm``: the same client against a ``vllm serve`` server (weight reload through vLLM's
  dev-mode ``/collective_rpc``; not verified by this project's tests).

A value that cannot run (a server engine without ``rollout.server_urls``, a URL that is not
``http(s)://host:port``, ``server_urls`` with the torch engine, ...) is refused by
:func:`check_engine` with one line naming the key, the value and what to use instead; the CLI
calls it before anything starts, and :func:`make_engine` calls it again. :func:`check_servers`
(``rollstream run`` / ``resume``, before anything starts) refuses a server URL where nothing answers;
:func:`servers_down` names the ones that stopped answering (a stall in ``rollstream status``).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from schemas.config import ConfigError, RunConfig, resolve_dtype

if TYPE_CHECKING:
    from rollout.engine import Engine

SERVER_ENGINES = ("server", "vllm")
"""Engines that are HTTP clients of a generation server (``rollout.server_urls``)."""
LABEL_ENV = "ROLLSTREAM_SERVICE_LABEL"
"""Where a rollout worker started by ``rollstream run`` finds its label (``rollout``, ``rollout0``...)."""


def check_url(url: str, key: str = "rollout.server_urls") -> str:
    """``url`` without a trailing slash; :class:`ConfigError` unless it is ``http(s)://host[:port]``
    (an optional path prefix is kept)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"config: {key} has {url!r}, not a URL ({e}); use http://host:port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"config: {key} has {url!r}; use http://host:port (the server's base URL, "
                          "without /v1/completions)")
    if port == 0:
        raise ConfigError(f"config: {key} has {url!r} with port 0; give the port the server listens on")
    if parts.path.rstrip("/").endswith(("/v1", "/v1/completions")):
        raise ConfigError(f"config: {key} has {url!r}; give the base URL without /v1 (e.g. http://host:8000)")
    return url.rstrip("/")


def check_engine(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the key, the value and what to use instead)
    unless ``rollout.engine`` and its settings can run here. Cheap: imports no engine, contacts no
    server (one that is down is retried by the client: ``rollout.server_down_s``)."""
    r = cfg.rollout
    if r.engine == "torch":
        if r.server_urls:
            raise ConfigError(f"config: rollout.server_urls={r.server_urls!r} is used only by rollout.engine "
                              "server or vllm; remove it, or set rollout.engine=server (rollstream serve) or vllm")
        return
    if r.engine not in SERVER_ENGINES:
        raise ConfigError(f"config: rollout.engine={r.engine!r} is not implemented in this version of rollstream; "
                          "use rollout.engine=torch, server or vllm")
    serve = "rollstream serve MODEL_DIR" if r.engine == "server" else "vllm serve MODEL_DIR"
    if not r.server_urls:
        raise ConfigError(f"config: rollout.engine={r.engine!r} needs rollout.server_urls (the base URLs of "
                          f"servers started with `{serve}`, e.g. ['http://127.0.0.1:8000']); or use "
                          "rollout.engine=torch")
    for url in r.server_urls:
        check_url(url)
    if not r.cuda_graphs:
        raise ConfigError(f"config: rollout.cuda_graphs=false applies to rollout.engine=torch only; with "
                          f"rollout.engine={r.engine!r} the server decides"
                          f"{' (rollstream serve --no-cuda-graphs)' if r.engine == 'server' else ''}: "
                          "remove rollout.cuda_graphs")
    if r.device != "auto":
        raise ConfigError(f"config: rollout.device={r.device!r} applies to rollout.engine=torch only; with "
                          f"rollout.engine={r.engine!r} the server picks its device ({serve} --device ...): "
                          "remove rollout.device")
    for key, value in (("server_timeout_s", r.server_timeout_s), ("server_down_s", r.server_down_s)):
        if not value > 0:
            raise ConfigError(f"config: rollout.{key}={value!r} must be > 0 (seconds)")
    if r.engine == "vllm" and r.top_p < 1:
        raise ConfigError(f"config: rollout.top_p={r.top_p!r} with rollout.engine='vllm': vLLM reports top-p "
                          "truncated logprobs (processed) or untempered ones (raw), not the tempered untruncated "
                          "behaviour logprobs the trainer recomputes; use rollout.top_p=1 with vllm, or "
                          "rollout.engine=server or torch")


SERVER_PROBE_S = 3.0
"""How long a generation server's port may take to accept a connection before it counts as down, seconds."""


async def _server_down(url: str, timeout_s: float) -> str | None:
    """Why nothing answers at ``url`` (a TCP connection to its host and port), or None when something does."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except ConnectionRefusedError:
        return "connection refused"
    except OSError as e:  # an unknown host, an unreachable network...
        return str(e.strerror or e or type(e).__name__)
    writer.close()
    return None


async def servers_down(urls: Sequence[str], timeout_s: float = SERVER_PROBE_S) -> dict[str, str]:
    """The URLs of ``urls`` where nothing accepts a connection within ``timeout_s``, with why (tried at once)."""
    why = await asyncio.gather(*(_server_down(u, timeout_s) for u in urls))
    return {u: w for u, w in zip(urls, why, strict=True) if w is not None}


def check_servers(cfg: RunConfig, timeout_s: float = SERVER_PROBE_S) -> None:
    """Raise :class:`ConfigError` naming the first URL of ``rollout.server_urls`` where nothing
    answers (a server engine only): a run would otherwise start and wait ``rollout.server_down_s``
    per sample. Later outages are retried by the client (``rollout.server_down_s``)."""
    r = cfg.rollout
    if r.engine not in SERVER_ENGINES or not r.server_urls:
        return
    down = asyncio.run(servers_down([check_url(u) for u in r.server_urls], timeout_s))
    if down:
        url, why = next(iter(down.items()))
        serve = "rollstream serve MODEL_DIR --port PORT" if r.engine == "server" else "vllm serve MODEL_DIR --port PORT"
        raise ConfigError(f"config: rollout.server_urls has {url!r} but no generation server answers there ({why}); "
                          f"start it (`{serve}`) or fix the URL")


def worker_index(label: str | None = None) -> int:
    """This rollout worker's index: the trailing number of its service label (``rollout3`` -> 3;
    ``rollout`` or no label -> 0). ``label`` None = ``$ROLLSTREAM_SERVICE_LABEL``."""
    label = os.environ.get(LABEL_ENV, "") if label is None else label
    match = re.search(r"(\d+)$", label)
    return int(match.group(1)) if match else 0


def server_url(cfg: RunConfig, index: int) -> str:
    """The server URL of rollout worker ``index``: ``rollout.server_urls[index % len]``."""
    urls = cfg.rollout.server_urls
    return check_url(urls[index % len(urls)])


def make_engine(
    cfg: RunConfig,
    model_dir: str | Path,
    *,
    device: str = "cpu",
    seed: int = 0,
    policy_version: int = -1,
    max_batch: int | None = None,
    local: bool = False,
    worker: int | None = None,
) -> Engine:
    """The generation engine ``cfg.rollout.engine`` names, rendering prompts per
    ``model.chat_template`` / ``model.system_prompt``.

    ``torch`` (or ``local=True``, as the trainer's greedy evaluation asks): a :class:`TorchEngine`
    loaded from ``model_dir`` onto ``device`` (a concrete torch device; ``model.dtype: auto``
    resolves for it). ``server`` / ``vllm``: a :class:`ServerEngine` that reads the tokenizer and
    model config from ``model_dir`` and generates on ``rollout.server_urls[worker % n]`` (``worker``
    None = this process's service label, :func:`worker_index`); ``device``, ``seed`` and
    ``max_batch`` do not apply to it (the server has its own; the worker's concurrency is
    ``rollout.max_batch``)."""
    if not local:
        check_engine(cfg)
    if not local and cfg.rollout.engine in SERVER_ENGINES:
        from rollout.server_engine import ServerEngine

        r = cfg.rollout
        return ServerEngine(
            model_dir,
            server_url(cfg, worker_index() if worker is None else worker),
            flavor="vllm" if r.engine == "vllm" else "server",
            timeout_s=r.server_timeout_s,
            down_s=r.server_down_s,
            policy_version=policy_version,
            chat_template=cfg.model.chat_template,
            system_prompt=cfg.model.system_prompt,
        )
    from rollout.engine import TorchEngine

    return TorchEngine(
        model_dir,
        max_batch=max_batch or cfg.rollout.max_batch,
        device=device,
        dtype=resolve_dtype(cfg.model.dtype, device),
        seed=seed,
        policy_version=policy_version,
        chat_template=cfg.model.chat_template,
        system_prompt=cfg.model.system_prompt,
        cuda_graphs=cfg.rollout.cuda_graphs,
    )
