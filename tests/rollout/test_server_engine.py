"""``ServerEngine`` against a real ``rollstream serve`` subprocess on the tiny model: the same
completions as the local TorchEngine, stop strings, weight reloads, cancellation, and a server that is
down (a clear error after the retry window) or comes up late (the request waits for it)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout.engine import Engine, GenerationRequest, TorchEngine, generate_all
from rollout.sampling import SamplingParams
from rollout.server_engine import ServerDown, ServerEngine
from tests.floats import assert_close

PROMPTS = ["12+34=", "7-3=", "99+1=", "5*6=", "123-45=", "8+8="]
GREEDY = SamplingParams(max_new_tokens=12, greedy=True)


def start_server(model_dir: Path, home: Path, port: int = 0) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", str(model_dir), "--port", str(port),
                             "--max-batch", "8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, ROLLSTREAM_HOME=str(home)))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("serving "), line
    return proc, line.split(" at ")[1].split()[0]


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_server(model_dir, tmp_path_factory.mktemp("home"))
    try:
        yield url
    finally:
        stop_server(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reqs(engine: Engine, params: SamplingParams) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", engine.encode(p), params) for i, p in enumerate(PROMPTS)]


async def test_generates_what_the_torch_engine_generates(server: str, model_dir: Path) -> None:
    client = ServerEngine(model_dir, server, policy_version=0)
    local = TorchEngine(model_dir, max_batch=8)
    assert isinstance(client, Engine)
    assert client.encode("12+34=") == local.encode("12+34=") and client.max_positions == local.max_positions
    try:
        got = await generate_all(client, reqs(client, GREEDY))
        want = await generate_all(local, reqs(local, GREEDY))
        for g, w in zip(got, want, strict=True):
            assert g.error == "" and g.token_ids == w.token_ids and g.text == w.text
            assert g.finish_reason == w.finish_reason and g.prompt_ids == w.prompt_ids
            # another engine instance, other batches: rounding only (terms: the hidden size)
            assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), local.model.config.hidden_size)
            assert g.policy_version == g.policy_version_end == 0  # the server's version
        # sampled: well-formed behaviour logprobs, a stream of requests joining while others run
        sampled = SamplingParams(max_new_tokens=10, temperature=0.8)

        async def stream():  # type: ignore[no-untyped-def]
            for r in reqs(client, sampled):
                yield r
                await asyncio.sleep(0.01)

        done = [c async for c in client.generate(stream())]
        assert sorted(c.request_id for c in done) == [f"r{i}" for i in range(len(PROMPTS))]
        assert all(len(c.token_ids) == len(c.logprobs) > 0 and max(c.logprobs) <= 0 for c in done)
    finally:
        await client.close()


async def test_stop_strings_end_where_the_torch_engine_ends(server: str, model_dir: Path) -> None:
    client = ServerEngine(model_dir, server)
    local = TorchEngine(model_dir, max_batch=8)
    try:
        (free,) = await generate_all(local, [GenerationRequest("a", local.encode("12+34="), GREEDY)])
        stop = free.text[2]  # a character the greedy text reaches after a few tokens
        params = SamplingParams(max_new_tokens=12, greedy=True, stop=(stop,))
        (g,) = await generate_all(client, [GenerationRequest("a", client.encode("12+34="), params)])
        (w,) = await generate_all(local, [GenerationRequest("a", local.encode("12+34="), params)])
        assert g.finish_reason == w.finish_reason == "stop"
        assert g.token_ids == w.token_ids and g.text == w.text and g.text.endswith(stop)
    finally:
        await client.close()


async def test_load_weights_reaches_the_server(server: str, model_dir: Path, other_model_dir: Path) -> None:
    client = ServerEngine(model_dir, server, policy_version=-1)
    try:
        (before,) = await generate_all(client, [GenerationRequest("a", client.encode("12+34="), GREEDY)])
        await client.load_weights(other_model_dir, 3)
        assert client.policy_version == 3
        (after,) = await generate_all(client, [GenerationRequest("a", client.encode("12+34="), GREEDY)])
        assert after.policy_version == after.policy_version_end == 3
        assert after.logprobs != before.logprobs
        await client.load_weights(model_dir, 4)  # back to the initial weights for the other tests
        with pytest.raises(RuntimeError, match="answered 400: load_weights: cannot load"):
            await client.load_weights(other_model_dir / "missing", 5)
        assert client.policy_version == 4
    finally:
        await client.close()


async def test_cancelling_a_generation_closes_its_requests(server: str, model_dir: Path) -> None:
    client = ServerEngine(model_dir, server)
    try:
        long = SamplingParams(max_new_tokens=60, temperature=1.0)
        reqs_ = [GenerationRequest(f"c{i}", client.encode("1+1="), long) for i in range(4)]
        never = asyncio.Event()

        async def stream():  # type: ignore[no-untyped-def]
            for r in reqs_:
                yield r
            await never.wait()  # a stream that stays open: generate() cannot finish on its own

        async def consume() -> list[object]:
            return [c async for c in client.generate(stream())]

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        assert not task.done()
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 1.0
        # the client and the server go on serving
        (c,) = await generate_all(client, [GenerationRequest("after", client.encode("7-3="), GREEDY)])
        assert c.error == "" and c.token_ids
    finally:
        await client.close()


async def test_a_server_that_is_down_is_a_clear_error(model_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = ServerEngine(model_dir, url, down_s=1.5)
    try:
        t0 = time.monotonic()
        (c,) = await generate_all(client, [GenerationRequest("x", client.encode("1+1="), GREEDY)])
        elapsed = time.monotonic() - t0
        assert c.finish_reason == "error" and c.token_ids == []
        assert f"generation server {url} unreachable for 1.5s" in c.error and "\n" not in c.error
        assert 1.0 <= elapsed < 5, elapsed  # retried with backoff, then gave up
        with pytest.raises(ServerDown, match="unreachable"):
            await client.load_weights(model_dir, 1)
        assert client.policy_version == -1
        with pytest.raises(ValueError, match=r"greedy at temperature 0\.5"):
            await generate_all(client, [GenerationRequest("g", [1, 2], SamplingParams(greedy=True, temperature=0.5))])
    finally:
        await client.close()


async def test_a_request_waits_for_a_server_that_comes_up_late(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    client = ServerEngine(model_dir, f"http://127.0.0.1:{port}", down_s=60)
    try:
        pending = asyncio.create_task(generate_all(client, [GenerationRequest("late", client.encode("1+1="), GREEDY)]))
        await asyncio.sleep(1.0)
        assert not pending.done()
        proc, _ = await asyncio.to_thread(start_server, model_dir, tmp_path / "home", port)
        try:
            (c,) = await asyncio.wait_for(pending, timeout=30)
            assert c.error == "" and c.token_ids
        finally:
            stop_server(proc)
    finally:
        await client.close()


def test_the_vllm_check_script_passes_here_and_fails_on_other_weights(server: str, model_dir: Path,
                                                                     other_model_dir: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/check_vllm_logprobs.py against `rollstream serve` (its half that runs without a GPU):
    the server's logprobs agree with the torch engine; with other weights loaded they do not."""
    import importlib.util
    import json
    import urllib.request

    path = Path(__file__).resolve().parents[2] / "scripts" / "check_vllm_logprobs.py"
    spec = importlib.util.spec_from_file_location("check_vllm_logprobs", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = [str(model_dir), "--url", server, "--max-tokens", "8", "--device", "cpu"]
    assert script.main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["greedy_identical"] == report["prompts"] == 8
    assert report["teacher_forced_sampled_max_abs_dlogprob"] < 1e-4

    def reload(weights: Path, version: int) -> None:
        req = urllib.request.Request(f"{server}/v1/load_weights", method="POST",
                                     data=json.dumps({"path": str(weights), "version": version}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200

    reload(other_model_dir, 10)
    try:
        assert script.main(args) == 1
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["teacher_forced_greedy_max_abs_dlogprob"] > 0.1
    finally:
        reload(model_dir, 11)


async def test_a_multi_turn_episode_through_the_server(tmp_path: Path) -> None:
    """The agent loop drives the server engine like the torch engine: the chat template is rendered
    here, the turns are one token sequence, and the trainer recomputes the server's logprobs."""
    from rollout.agent import AgentLimits, run_episode, turn_spans
    from rollout.model_init import init_tiny_model
    from schemas.config import TinyModelSpec
    from tests.rollout.test_agent import SYSTEM, client
    from trainer.batch import TrainSample, collate
    from trainer.strategy import TorchStrategy

    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=512,
                         tokenizer="bpe", chat_template=True)
    chat_dir = init_tiny_model(tmp_path / "bpe", spec, seed=5)
    proc, url = await asyncio.to_thread(start_server, chat_dir, tmp_path / "home")
    engine = ServerEngine(chat_dir, url, policy_version=0)
    try:
        assert engine.chat
        traj = await run_episode(engine, engine.tokenizer, client(), episode_id="e1", env="corridor",
                                 env_kwargs={"length": 3}, seed=7, params=SamplingParams(max_new_tokens=6),
                                 limits=AgentLimits(max_turns=5, max_tokens_per_turn=6), system_prompt=SYSTEM)
    finally:
        await engine.close()
        stop_server(proc)
    assert traj.finish == "terminated" and traj.num_turns == 3 and len(turn_spans(traj.loss_mask)) == 3
    assert traj.versions == [(0, 0)] * 3
    strategy = TorchStrategy(chat_dir, temperature=1.0, micro_batch_size=2)
    batch = collate([TrainSample(traj.prompt_ids, traj.response_ids, traj.logprobs, traj.loss_mask, 1.0,
                                 group_id="g")], strategy.pad_id)
    mask = batch.loss_mask.bool()
    # the server's cached decode steps and the trainer's one pass round differently (terms: the hidden size)
    assert_close(strategy.logprobs(batch)[mask], batch.old_logprobs[mask], strategy.model.config.hidden_size)
