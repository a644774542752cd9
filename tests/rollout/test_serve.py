"""``rollstream serve``: the completions server over a real TorchEngine on the tiny model.

In-process (aiohttp on a free port): greedy token ids and logprobs equal the engine's own, concurrent
requests share decode steps, weight reloads change outputs and versions, bad requests are a 400 with
one line. As a subprocess: ``--help``, bad arguments in one line, SIGTERM stops it cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file

from rollout.engine import GenerationRequest, TorchEngine, generate_all
from rollout.sampling import SamplingParams
from rollout.serve import Server, ServeSettings
from weights import read_weights

PROMPTS = ["12+34=", "7-3=", "99+1=", "5*6="]


@pytest.fixture(scope="module")
def noisy_weights(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights plus N(0, 0.5) noise, as a published-weights directory."""
    gen = torch.Generator().manual_seed(7)
    state = {k: (v + torch.randn(v.shape, generator=gen) * 0.5).contiguous() for k, v in read_weights(model_dir).items()}
    out = tmp_path_factory.mktemp("weights") / "v5"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    return out


class Served:
    def __init__(self, server: Server, url: str) -> None:
        self.server, self.url = server, url
        self.engine = server.engine

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.post(f"{self.url}{path}", json=body) as r:
            return r.status, await r.json()


@pytest.fixture
async def served(model_dir: Path) -> AsyncIterator[Served]:
    settings = ServeSettings(model_dir=str(model_dir), port=0, max_batch=8)
    server = Server(settings, TorchEngine(model_dir, max_batch=8, chat_template=False))
    runner = web.AppRunner(server.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield Served(server, f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


def body(prompt: Any, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, **kw}


async def test_greedy_tokens_and_logprobs_equal_the_engine(served: Served, model_dir: Path) -> None:
    reference = TorchEngine(model_dir, max_batch=8, chat_template=False)
    ids = [reference.encode(p) for p in PROMPTS]
    want = await generate_all(reference, [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=10, greedy=True))
                                          for i, p in enumerate(ids)])
    status, reply = await served.post("/v1/completions", body(ids))  # a batch of token-id prompts
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == list(range(len(PROMPTS)))
    for c, w in zip(reply["choices"], want, strict=True):
        tokens = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        assert tokens == c["token_ids"] == w.token_ids
        assert torch.allclose(torch.tensor(c["logprobs"]["token_logprobs"]), torch.tensor(w.logprobs), atol=1e-5)
        assert c["finish_reason"] == w.finish_reason and c["text"] == w.text
        assert c["policy_version"] == c["policy_version_end"] == 0
    assert reply["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    # a string prompt is encoded as bare text; text tokens (not ids) when not asked for ids
    status, one = await served.post("/v1/completions", body(PROMPTS[0], return_tokens_as_token_ids=False))
    assert status == 200 and one["choices"][0]["token_ids"] == want[0].token_ids
    assert "".join(one["choices"][0]["logprobs"]["tokens"]) == want[0].text


async def test_sampled_n_and_stop_strings(served: Served) -> None:
    ids = served.engine.encode("12+34=")
    status, reply = await served.post("/v1/completions", body(ids, n=3, temperature=0.8, max_tokens=8))
    assert status == 200 and len(reply["choices"]) == 3
    assert all(len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"]) for c in reply["choices"])
    assert all(lp <= 0 for c in reply["choices"] for lp in c["logprobs"]["token_logprobs"])
    # stop at the second character of the greedy text: ids keep the completing token, text drops the stop
    _, greedy = await served.post("/v1/completions", body(ids))
    text = greedy["choices"][0]["text"]
    stop = text[1]
    status, stopped = await served.post("/v1/completions", body(ids, stop=[stop]))
    c = stopped["choices"][0]
    assert status == 200 and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert c["text"] == text[: text.index(stop)]
    assert str(served.engine.tokenizer.decode(c["token_ids"])).endswith(stop)
    _, kept = await served.post("/v1/completions", body(ids, stop=stop, include_stop_str_in_output=True))
    assert kept["choices"][0]["text"] == text[: text.index(stop) + 1]
    # no max_tokens: up to the model's context (64 positions)
    status, full = await served.post("/v1/completions", body(ids, max_tokens=None))
    c = full["choices"][0]
    assert status == 200 and (c["finish_reason"] == "stop" or len(ids) + len(c["token_ids"]) == 64)
    assert c["stop_reason"] is None


async def test_concurrent_requests_share_decode_steps(served: Served) -> None:
    ids = [served.engine.encode(p) for p in PROMPTS * 2]
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, served.engine.running)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    replies = await asyncio.gather(*[served.post("/v1/completions", body(p, max_tokens=30)) for p in ids])
    watcher.cancel()
    assert all(status == 200 for status, _ in replies)
    assert peak >= 2, "concurrent requests never ran in the same batch"
    # greedy: the same prompt gives the same tokens whatever it was batched with
    first, second = replies[: len(PROMPTS)], replies[len(PROMPTS):]
    assert [r["choices"][0]["token_ids"] for _, r in first] == [r["choices"][0]["token_ids"] for _, r in second]


async def test_load_weights_changes_outputs_and_versions(served: Served, noisy_weights: Path) -> None:
    ids = served.engine.encode("12+34=")
    _, before = await served.post("/v1/completions", body(ids))
    status, loaded = await served.post("/v1/load_weights", {"path": str(noisy_weights), "version": 5})
    assert status == 200 and loaded == {"policy_version": 5, "reloaded": True}
    _, again = await served.post("/v1/load_weights", {"path": str(noisy_weights), "version": 5})
    assert again == {"policy_version": 5, "reloaded": False}  # a second worker's reload is a no-op
    _, after = await served.post("/v1/completions", body(ids))
    b, a = before["choices"][0], after["choices"][0]
    assert a["policy_version"] == a["policy_version_end"] == 5
    assert a["logprobs"]["token_logprobs"] != b["logprobs"]["token_logprobs"]
    async with aiohttp.ClientSession() as s, s.get(f"{served.url}/health") as r:
        assert (await r.json())["policy_version"] == 5
    status, bad = await served.post("/v1/load_weights", {"path": str(noisy_weights.parent / "missing")})
    assert status == 400 and "cannot load" in bad["message"] and "\n" not in bad["message"]
    assert served.engine.policy_version == 5


@pytest.mark.parametrize(("request_body", "status", "words"), [
    (body([1, 2], foo=1), 400, "unknown field `foo`"),
    (body([1, 2], seed=3), 400, "seed=3 is refused"),
    (body([1, 2], logprobs=2), 400, "use logprobs=0"),
    (body([1, 10**6]), 400, "outside the vocabulary"),
    (body([1] * 64), 400, "maximum context length is 64"),
    (body([1, 2], temperature=-1), 400, "temperature=-1"),
    (body([1, 2], max_tokens=0), 400, "max_tokens=0"),
    (body([], ), 400, "prompt must be"),
    (body([1, 2], stream=True), 400, "stream=True is refused"),
    (body([1, 2], model="gpt-4"), 404, "not served here"),
    ("not json", 400, "not JSON"),
])
async def test_bad_requests_are_one_line(served: Served, request_body: Any, status: int, words: str) -> None:
    async with aiohttp.ClientSession() as s:
        data = request_body if isinstance(request_body, str) else None
        async with s.post(f"{served.url}/v1/completions", data=data,
                          json=None if data is not None else request_body) as r:
            reply = await r.json()
            assert r.status == status, reply
    assert words in reply["message"] and "\n" not in reply["message"], reply
    assert reply["object"] == "error"


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize(("change", "words"), [
    ({"port": 70000}, "--port=70000 is not a TCP port"), ({"dtype": "float8"}, "--dtype='float8'"),
    ({"max_batch": 0}, "--max-batch=0 must be >= 1"), ({"model_dir": "/nonexistent"}, "not a model directory"),
])
def test_settings_are_checked_in_one_line(model_dir: Path, change: dict[str, Any], words: str) -> None:
    import msgspec

    from rollout.serve import check_settings
    from schemas.config import ConfigError

    settings = msgspec.structs.replace(ServeSettings(model_dir=str(model_dir)), **change)
    with pytest.raises(ConfigError) as err:
        check_settings(settings)
    assert words in str(err.value) and "\n" not in str(err.value)


def rollstream(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          timeout=60, **kw)


def test_help_and_bad_arguments_are_one_line(tmp_path: Path, model_dir: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_HOME=str(tmp_path / "home"))
    res = rollstream("serve", "--help", env=env)
    assert res.returncode == 0 and "/v1/load_weights" in res.stdout and "--max-batch" in res.stdout
    for args, words in [((str(tmp_path / "nope"),), "not a model directory"),
                        ((str(model_dir), "--port", "abc"), "Invalid value for '--port'")]:
        res = rollstream("serve", *args, env=env)
        lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
        assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), lines
        assert words in lines[0], lines[0]


def test_serves_until_sigterm(tmp_path: Path, model_dir: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_HOME=str(tmp_path / "home"))
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", str(model_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving m at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]

        async def ask() -> tuple[int, Any]:
            async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body([1, 5, 6])) as r:
                return r.status, await r.json()

        status, reply = asyncio.run(ask())
        assert status == 200 and len(reply["choices"][0]["token_ids"]) > 0
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 20
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
