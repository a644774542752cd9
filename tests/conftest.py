"""Shared fixtures: a real Kafka broker and a real ClickHouse engine (chDB).

``bootstrap``: ``$ROLLSTREAM_BOOTSTRAP`` when set (``make test`` starts the local broker and
sets it); otherwise this session starts its own local broker in a temporary home and stops it
at the end. A broker that cannot be reached or started is a test FAILURE, never a skip.

``store_dsn``: one embedded store for the whole test process (chDB lets a process open only one
store directory); tests isolate themselves by ``run_id``.

``visual_run``: one short recorded visual run (``examples/vision.yaml``, 2 steps), shared by the
``bench`` tests of report, replay step and rescore on visual runs (35 s on a quiet machine).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from schemas.config import KafkaSettings, TinyModelSpec

TINY_SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
"""The shape of the tiny test model (a few hundred kB)."""


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from infra.kafka import broker as stack

    explicit = os.environ.get("ROLLSTREAM_BOOTSTRAP")
    if explicit:
        if not stack.kafka_reachable(explicit, timeout_s=15):
            pytest.fail(f"ROLLSTREAM_BOOTSTRAP={explicit} does not answer (is the broker up?)")
        yield explicit
        return
    home = tmp_path_factory.mktemp("kafka-home")
    try:
        stack.ensure_kafka_jars()
        proc, _ = stack.start_local_kafka(home)
    except stack.StackError as e:
        pytest.fail(f"could not start a local Kafka broker for the tests: {e}")
    try:
        yield proc.bootstrap
    finally:
        stack.stop_local_kafka(home)


@pytest.fixture(scope="session")
def store_dsn(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"chdb://{tmp_path_factory.mktemp('store') / 'chdb'}"


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF model directory (Llama architecture, own tokenizer), created once per session."""
    import torch
    from transformers.utils import logging as hf_logging

    from rollout.model_init import init_tiny_model

    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", TINY_SPEC, seed=0)


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny vision-language model directory (Qwen2-VL, char tokenizer with image tokens, image
    processor), created once per session."""
    import torch
    from transformers.utils import logging as hf_logging

    from rollout.vlm import init_tiny_vlm

    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return init_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "m", TINY_SPEC, seed=0)


@pytest.fixture(scope="session")
def vlm25_dir(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL directory (a windowed-attention vision tower with a full-attention last
    block, SwiGLU MLPs, RMSNorm) with :func:`vlm_dir`'s language model shape, tokenizer, chat
    template and image processor: a ``model.path`` of the other architecture ``model.path`` takes."""
    import json
    import shutil

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out = tmp_path_factory.mktemp("tiny_vlm25") / "m"
    shutil.copytree(vlm_dir, out, ignore=shutil.ignore_patterns("config.json", "*.safetensors"))
    cfg = json.loads((vlm_dir / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    config = Qwen2_5_VLConfig(
        text_config={k: v for k, v in text.items() if k != "model_type"},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                           patch_size=vision["patch_size"], spatial_merge_size=vision["spatial_merge_size"],
                           temporal_patch_size=vision["temporal_patch_size"], window_size=56, fullatt_block_indexes=[1]),
        **{k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def shm_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Shared-memory weight segments written in this process (a trainer's ``weights_handoff``) go
    to a temporary folder, not ``/dev/shm``, so that no test leaves one behind."""
    import weights.shm

    path = tmp_path_factory.mktemp("shm")
    monkeypatch.setattr(weights.shm, "SHM_DIR", path)
    return path


@pytest.fixture
def kafka(bootstrap: str) -> KafkaSettings:
    """Kafka settings of the test broker (short timeouts)."""
    return KafkaSettings(bootstrap=bootstrap, connect_timeout_s=10.0, request_timeout_s=15.0)


@pytest.fixture
async def topics(kafka: KafkaSettings, run_id: str) -> AsyncIterator[list[str]]:
    """The run's topics, created for the test and deleted after it."""
    from runtime.bus import TopicAdmin

    async with TopicAdmin(kafka) as admin:
        names = await admin.ensure_run_topics(run_id)
        yield names
        await admin.delete_run_topics(run_id)


SHORT_VISUAL = [
    "train.steps=2", "train.warmup_sft_steps=2", "train.warmup_batch_size=8", "train.eval_every=2",
    "train.checkpoint_every=2", "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=8",
    "train.micro_batch_size=8", "algorithm.entropy_loss_coef=0.01",  # a gradient at every step
]
"""A short visual run: a 2-step warm-up, 2 steps of 2 groups of 4, 8 held-out images evaluated at
steps 0 and 2, checkpoints at steps 0 and 2."""


@dataclass(frozen=True)
class VisualRun:
    run_id: str
    runs: Path
    """The runs directory (``runs/<run_id>/blobs`` holds its images)."""
    env: dict[str, str]
    """The environment its commands run with (the test broker)."""


@pytest.fixture(scope="session")
def visual_run(tmp_path_factory: pytest.TempPathFactory, bootstrap: str, repo_root: Path) -> Iterator[VisualRun]:
    """One short recorded visual run (:data:`SHORT_VISUAL`) in its own embedded store; its topics are
    deleted afterwards. For ``bench`` tests only: it takes 35 s (quiet machine) to 100 s."""
    import asyncio
    import subprocess
    import sys

    from runtime.bus import TopicAdmin

    runs = tmp_path_factory.mktemp("visual") / "runs"
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    run_id = f"vis-{uuid.uuid4().hex[:8]}"
    res = subprocess.run([sys.executable, "-m", "cli", "run", str(repo_root / "examples" / "vision.yaml"), "--run-id",
                          run_id, *[a for kv in [*SHORT_VISUAL, f"run.runs_dir={runs}"] for a in ("--set", kv)]],
                         capture_output=True, text=True, env=env, timeout=400, cwd=repo_root)
    assert res.returncode == 0, res.stdout + res.stderr
    yield VisualRun(run_id, runs, env)

    async def cleanup() -> None:
        async with TopicAdmin(KafkaSettings(bootstrap=bootstrap)) as admin:
            await admin.delete_run_topics(run_id)

    asyncio.run(cleanup())
