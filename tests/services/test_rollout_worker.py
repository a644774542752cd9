"""The rollout worker's pieces that need no broker: an episode as a ``Generation``; how long a task
waits for its weights; which copy of a version it swaps in (shared memory here, received from the
trainer's node, else the directory)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollout.agent import Trajectory
from schemas import events as ev
from schemas.config import RunConfig
from schemas.sanity import check_generation
from services.rollout_worker import RolloutSettings, RolloutWorker, Superseded, generation_of


class Tok:
    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def task() -> ev.RolloutTask:
    return ev.RolloutTask(run_id="r", sample_id="g0/1", group_id="g0", index=1, group_size=2, prompt_id="frozenlake:3",
                          domain="lake", prompt="", reference='{"env": "frozenlake", "seed": 3, "kwargs": {}}',
                          env=ev.EnvSpec(name="frozenlake"), ts=100.0)


def test_an_episode_becomes_one_generation_with_its_turns() -> None:
    infos: list[dict[str, Any]] = [{"state_hash": "s0"}, {"state_hash": "s1"}, {"state_hash": "s2", "success": True}]
    traj = Trajectory(prompt_ids=[1, 2], response_ids=[5, 6, 0, 0, 7], logprobs=[-0.5, -0.1, 0.0, 0.0, -0.2],
                      loss_mask=[1, 1, 0, 0, 1], step_rewards=[0.0, 1.0], actions=["down", "right"],
                      observations=["o0", "o1", "o2"], versions=[(3, 3), (4, 4)], infos=infos, finish="terminated",
                      success=True, gen_s=1.5, env_s=0.25)
    gen = generation_of(task(), traj, "g0/1@0123abcd", "w0", Tok(), queued_s=2.0)
    assert check_generation(gen) is None
    assert (gen.policy_version, gen.policy_version_end, gen.turn_versions) == (3, 4, [3, 4])
    assert gen.state_hashes == ["s0", "s1"]  # the state each turn acted from: the observation before it
    assert (gen.num_turns, gen.step_rewards, gen.env_finish, gen.success) == (2, [0.0, 1.0], "terminated", True)
    assert gen.finish_reason == "stop" and gen.response_text == "5 6 0 0 7" and gen.episode_id == "g0/1@0123abcd"
    assert (gen.gen_s, gen.env_s, gen.queued_s, gen.worker_id) == (1.5, 0.25, 2.0, "w0")
    cut = generation_of(task(), Trajectory(prompt_ids=[1], response_ids=[5], logprobs=[-1.0], loss_mask=[1],
                                           step_rewards=[0.0], actions=["x"], versions=[(0, 0)], infos=[{}],
                                           finish="context"), "e", "w", Tok(), 0.0)
    assert cut.finish_reason == "length" and cut.state_hashes == [""]


async def test_version_0_is_awaited_past_the_timeout_later_versions_are_not() -> None:
    """Version 0 comes after the trainer's warm-up, however long: a task waiting for it must not
    fail after ``weights_timeout_s`` (64 first episodes were dead-lettered by an 11-minute warm-up)."""
    worker = RolloutWorker.__new__(RolloutWorker)  # only what _wait_for_version reads
    worker.s = RolloutSettings(run_id="r", config=RunConfig(), model_dir="unused", weights_timeout_s=0.05)
    worker.engine = SimpleNamespace(policy_version=-1)  # type: ignore[assignment]
    worker._version_changed = asyncio.Condition()
    worker.release = "off"

    first = asyncio.create_task(worker._wait_for_version(0))
    await asyncio.sleep(0.3)  # six timeouts long
    assert not first.done()
    worker.engine.policy_version = 0
    async with worker._version_changed:
        worker._version_changed.notify_all()
    await asyncio.wait_for(first, 1.0)
    with pytest.raises(TimeoutError):
        await worker._wait_for_version(1)  # a later version keeps the limit


async def test_weights_come_from_shared_memory_on_this_node_else_from_the_directory(model_dir: Path,
                                                                                     tmp_path: Path) -> None:
    """The sealed segment of the event is swapped in; once it is gone (or on another node) the
    version's directory is, waited for while the trainer still writes it (until a newer version
    comes); on another node with the trainer's sender, the segment received from it."""
    import msgspec
    import torch

    from rollout.agent import SwapLock
    from rollout.engine import TorchEngine
    from weights import new_segment_path, node_id, read_weights, write_segment, write_state_dir
    from weights.broadcast import Relay, WeightSender

    worker = RolloutWorker.__new__(RolloutWorker)  # only what _load reads
    worker.s = RolloutSettings(run_id="r", config=RunConfig(), model_dir=str(model_dir), weights_timeout_s=5.0)
    worker.engine = engine = TorchEngine(model_dir, max_batch=2)
    worker.worker_id = "w"
    worker.swap_lock, worker.relay = SwapLock(), Relay(tmp_path / "this-node")
    base = read_weights(model_dir)

    def version(v: int) -> tuple[dict[str, torch.Tensor], ev.WeightsPublished]:
        state = {k: t + v for k, t in base.items()}
        seg = write_segment(new_segment_path("rollstream-r-0a1b2c3d", v, tmp_path), state)
        return state, ev.WeightsPublished(run_id="r", policy_version=v, step=v, uri=str(tmp_path / f"v{v}"),
                                          memory=str(seg.path), memory_host=node_id(), memory_checksum=seg.checksum)

    def holds(state: dict[str, torch.Tensor]) -> bool:
        live = dict(engine.model.named_parameters())
        return all(torch.equal(live[k], t) for k, t in state.items() if k in live)

    one, e1 = version(1)
    assert await worker._load(e1) == "shared memory" and engine.policy_version == 1 and holds(one)
    two, e2 = version(2)
    Path(e2.memory).unlink()  # pruned meanwhile: the directory, written a little later
    writer = asyncio.create_task(asyncio.sleep(0.3))
    writer.add_done_callback(lambda _: write_state_dir(e2.uri, two, like=model_dir))
    assert await worker._load(e2) == "disk" and engine.policy_version == 2 and holds(two)
    three, e3 = version(3)
    write_state_dir(e3.uri, three, like=model_dir)
    elsewhere = ev.WeightsPublished(**{**{f: getattr(e3, f) for f in e3.__struct_fields__}, "memory_host": "other"})
    assert await worker._load(elsewhere) == "disk" and holds(three)
    # on another node with the trainer's sender: received into this node's shared memory, then swapped in
    (tmp_path / "this-node").mkdir()
    sender = WeightSender("127.0.0.1", timeout_s=20.0)
    try:
        four, e4 = version(4)
        sender.offer(4, Path(e4.memory))
        sent = msgspec.structs.replace(e4, memory_host="trainer-node", broadcast=sender.url)
        assert await worker._load(sent) == f"shared memory, received from {sender.url}" and holds(four)
        assert (tmp_path / "this-node" / Path(e4.memory).name).is_file() and sender.sent == 1
        five, e5 = version(5)  # the sender does not hold it: the directory
        write_state_dir(e5.uri, five, like=model_dir)
        gone = msgspec.structs.replace(e5, memory_host="trainer-node", broadcast=sender.url)
        assert await worker._load(gone) == "disk" and holds(five) and worker.engine.policy_version == 5
    finally:
        sender.close()
    # a trainer that died before writing a version's directory: a newer version ends the wait at once
    _, e6 = version(6)
    Path(e6.memory).unlink()
    polls: list[float] = []

    async def superseded() -> bool:
        polls.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.05)
        return len(polls) == 3

    t0 = asyncio.get_running_loop().time()
    with pytest.raises(Superseded, match=r"weights v6 skipped: its directory .* is not there"):
        await worker._load(e6, superseded)
    assert len(polls) == 3 and polls[-1] - t0 < 2.0 and engine.policy_version == 5  # not the 5 s timeout


async def test_a_visual_task_is_generated_from_its_blobs_and_a_bad_blob_names_the_sample(vlm_dir: Path,
                                                                                          tmp_path: Path) -> None:
    """A task with image hashes: its images come from the run's blob store into the VLM's prefill (the
    prompt holds their image tokens); a missing or undecodable blob fails the task with its sample and
    the blob named (the runtime dead-letters it with that reason)."""
    import envs
    from blobs import BlobStore

    store = BlobStore(tmp_path / "blobs")
    problem = envs.make_source("shapes").problem(7)
    good = store.put(problem.images[0])
    junk = store.put(b"not an image")
    worker = RolloutWorker(RolloutSettings(run_id="r", config=RunConfig(), model_dir=str(vlm_dir),
                                           blob_dir=str(store.root)))
    worker.engine.policy_version = 0
    out: list[ev.Event] = []
    ctx = SimpleNamespace(emit=lambda topic, e, key=None: out.append(e))

    def visual(hashes: list[str]) -> ev.RolloutTask:
        return ev.RolloutTask(run_id="r", sample_id="g0/0", group_id="g0", index=0, group_size=1,
                              prompt_id=problem.prompt_id, domain="arith", prompt=problem.prompt,
                              reference=problem.reference, image_hashes=hashes)

    await worker.handle(SimpleNamespace(event=visual([good])), ctx)  # type: ignore[arg-type]
    gen = out[0]
    assert isinstance(gen, ev.Generation) and gen.task.image_hashes == [good] and check_generation(gen) is None
    assert gen.prompt_ids.count(worker.engine.model.config.image_token_id) == 4  # 56 x 56 px: 2 x 2 merged patches
    missing = "0" * 64
    with pytest.raises(ValueError, match=f"task g0/0: image unusable: blob {missing}: missing from the blob store"):
        await worker.handle(SimpleNamespace(event=visual([good, missing])), ctx)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"task g0/0: image unusable: blob {junk}: not a decodable image"):
        await worker.handle(SimpleNamespace(event=visual([junk])), ctx)  # type: ignore[arg-type]
    assert len(out) == 1


async def test_an_idle_worker_releases_its_engine_and_reports_its_peak_memory(model_dir: Path) -> None:
    """``rollout.release_between_steps``: the engine gives back its memory once the worker's last task
    is done and while a task waits for a newer version; the next task's generation takes it back.
    Each ``Generation`` carries the worker's peak memory (peak RSS on the CPU)."""
    from runtime.memory import peak_memory_gib
    from schemas.config import parse_config

    cfg = parse_config("rollout: {async_ratio: 0, release_between_steps: kv_and_weights, device: cpu, "
                       "max_new_tokens: 4}")
    worker = RolloutWorker(RolloutSettings(run_id="r", config=cfg, model_dir=str(model_dir), weights_timeout_s=0.2))
    from rollout.engine import TorchEngine

    engine = worker.engine
    assert isinstance(engine, TorchEngine)
    emitted: list[ev.Event] = []
    ctx = SimpleNamespace(emit=lambda topic, event, key=None: emitted.append(event))
    domain = cfg.data.domains[0].name

    def rec(version: int, i: int) -> Any:
        t = ev.RolloutTask(run_id="r", sample_id=f"g{i}/0", group_id=f"g{i}", index=0, group_size=1,
                           prompt_id="p", domain=domain, prompt="1+2=", reference="3", policy_version=version)
        return SimpleNamespace(event=t)

    with pytest.raises(RuntimeError, match="weights version 1 not published"):  # waits: the engine is idle
        await asyncio.wait_for(worker.handle(rec(1, 0), ctx), 5.0)  # type: ignore[arg-type]
    assert worker._releasing is not None and await worker._releasing and engine.released == "kv_and_weights"
    engine.policy_version = 0
    await worker.handle(rec(0, 1), ctx)  # type: ignore[arg-type]
    assert len(emitted) == 1 and engine.releases == 1
    assert worker._releasing is not None and await worker._releasing  # released again after its last task
    assert engine.released == "kv_and_weights" and engine.releases == 2
    gen = emitted[0]
    assert isinstance(gen, ev.Generation) and gen.response_ids and gen.policy_version == 0
    assert 0 < gen.peak_memory_gib <= peak_memory_gib("cpu")
