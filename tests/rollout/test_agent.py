"""The agent loop: a multi-turn episode as one token sequence, on a tiny BPE model with a ChatML
template and an in-process environment."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

from envs.base import StepResult
from rollout.agent import AgentLimits, LocalEnvClient, Observation, run_episode, turn_spans
from rollout.engine import TorchEngine
from rollout.model_init import init_tiny_model
from rollout.sampling import SamplingParams
from schemas.config import TinyModelSpec
from tests.floats import assert_close
from trainer.batch import TrainSample, collate
from trainer.strategy import TorchStrategy

SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=2048,
                     tokenizer="bpe", chat_template=True)
SYSTEM = "You walk a corridor."


class Corridor:
    """Scripted: reward 0.5 per turn, ends after ``length`` turns (or raises at ``crash_at``)."""

    def __init__(self, length: int = 3, crash_at: int = 0, **_: Any) -> None:
        self.length, self.crash_at, self.t = length, crash_at, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.t = 0
        return f"start {seed}", {"state_hash": "s0"}

    def step(self, action: str) -> StepResult:
        self.t += 1
        if self.t == self.crash_at:
            raise RuntimeError("the corridor collapsed")
        done = self.t >= self.length
        return StepResult(f"room {self.t}", 0.5, done, False, {"success": done, "state_hash": f"s{self.t}"})


def client() -> LocalEnvClient:
    return LocalEnvClient(lambda name, prompt="", reference="", **kw: Corridor(**kw))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("agent") / "bpe", SPEC, seed=5)


async def episode(engine: TorchEngine, limits: AgentLimits = AgentLimits(max_turns=5, max_tokens_per_turn=6),
                  **kw: Any):
    return await run_episode(engine, engine.tokenizer, client(), episode_id="e1", env="corridor", env_kwargs=kw,
                             seed=7, params=SamplingParams(max_new_tokens=6, temperature=1.0), limits=limits,
                             system_prompt=SYSTEM)


async def test_tokens_are_the_rendered_conversation_with_model_tokens_masked_in(chat_dir: Path) -> None:
    engine = TorchEngine(chat_dir, max_batch=4, seed=1)
    traj = await episode(engine, length=3)
    assert traj.finish == "terminated" and traj.success and traj.num_turns == 3
    assert traj.step_rewards == [0.5, 0.5, 0.5] and traj.episode_return == 1.5
    assert traj.observations == ["start 7", "room 1", "room 2", "room 3"]
    assert len(traj.response_ids) == len(traj.logprobs) == len(traj.loss_mask)
    spans = turn_spans(traj.loss_mask)
    assert len(spans) == 3  # one contiguous run of model tokens per turn
    assert all(traj.logprobs[i] == 0.0 for i, m in enumerate(traj.loss_mask) if not m)
    tok = engine.tokenizer
    text = tok.decode(traj.prompt_ids + traj.response_ids)
    # the whole sequence is the chat template's rendering of the conversation (the last turn open)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "start 7"}]
    for i, action in enumerate(traj.actions[:-1]):
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": f"room {i + 1}"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    last = tok.decode(traj.response_ids[spans[-1][0]:])
    assert text == rendered + last
    # model tokens are exactly what was sampled: the trainer's logprobs of the whole sequence agree
    strategy = TorchStrategy(chat_dir, temperature=1.0, micro_batch_size=2)
    batch = collate([TrainSample(traj.prompt_ids, traj.response_ids, traj.logprobs, traj.loss_mask, 1.0,
                                 group_id="g")], strategy.pad_id)
    mask = batch.loss_mask.bool()
    # the engine's cached decode steps and the trainer's one pass round differently (terms: the hidden size)
    assert_close(strategy.logprobs(batch)[mask], batch.old_logprobs[mask], strategy.model.config.hidden_size)
    assert traj.versions == [(0, 0)] * 3 and traj.versions_consistent


async def test_limits_and_failures_end_the_episode_with_what_was_played(chat_dir: Path) -> None:
    engine = TorchEngine(chat_dir, max_batch=4, seed=2)
    capped = await episode(engine, AgentLimits(max_turns=2, max_tokens_per_turn=4), length=9)
    assert capped.finish == "max_turns" and capped.num_turns == 2 and not capped.success
    assert all(b - a <= 4 for a, b in turn_spans(capped.loss_mask))
    tight = await episode(engine, AgentLimits(max_turns=9, max_tokens_per_turn=6, max_context_tokens=70), length=9)
    assert tight.finish == "context" and len(tight.prompt_ids) + len(tight.response_ids) <= 70
    crashed = await episode(engine, length=5, crash_at=2)
    assert crashed.finish == "env_error" and "the corridor collapsed" in crashed.error
    assert crashed.num_turns == 2 and crashed.step_rewards == [0.5, 0.0]


async def test_a_failed_reset_is_an_env_error_not_an_exception(chat_dir: Path) -> None:
    engine = TorchEngine(chat_dir, max_batch=2)
    bad = LocalEnvClient(lambda *a, **k: (_ for _ in ()).throw(ValueError("no such env")))
    traj = await run_episode(engine, engine.tokenizer, bad, episode_id="e", env="x", env_kwargs={}, seed=0,
                             params=SamplingParams(max_new_tokens=4))
    assert traj.finish == "env_error" and "no such env" in traj.error and traj.num_turns == 0


async def test_frozenlake_expert_through_the_loop(chat_dir: Path) -> None:
    """A real registered environment through the in-process client, with the model's actions replaced
    by the expert's (the loop, the env protocol and the rewards line up)."""
    import envs
    from envs.frozenlake import expert_actions

    actions = iter(expert_actions(3))

    class Scripted(LocalEnvClient):
        async def step(self, episode_id: str, step: int, action: str, *, history: list[str],
                       policy_version: int) -> Observation:
            return await super().step(episode_id, step, next(actions), history=history, policy_version=policy_version)

    engine = TorchEngine(chat_dir, max_batch=2)
    traj = await run_episode(engine, engine.tokenizer, Scripted(envs.make_env), episode_id="f", env="frozenlake",
                             env_kwargs={"size": 4}, seed=3, params=SamplingParams(max_new_tokens=3),
                             limits=AgentLimits(max_turns=20, max_tokens_per_turn=3, max_context_tokens=2000))
    assert traj.success and traj.finish == "terminated" and traj.episode_return == 1.0
    assert traj.step_rewards[-1] == 1.0 and sum(traj.step_rewards[:-1]) == 0.0


def test_turn_spans() -> None:
    assert turn_spans([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert turn_spans([]) == [] and turn_spans([0, 0]) == []


async def test_swap_lock_keeps_swaps_out_of_turns_and_is_not_starved() -> None:
    import asyncio

    from rollout.agent import SwapLock

    lock = SwapLock()
    log: list[str] = []

    async def turn(name: str, hold_s: float) -> None:
        async with lock.turn():
            log.append(f"{name}+")
            await asyncio.sleep(hold_s)
            log.append(f"{name}-")

    async def swap() -> None:
        async with lock.swap():
            log.append("swap+")
            await asyncio.sleep(0.01)
            log.append("swap-")

    first = asyncio.create_task(turn("a", 0.05))
    await asyncio.sleep(0.01)
    swapper = asyncio.create_task(swap())
    await asyncio.sleep(0.01)
    late = asyncio.create_task(turn("b", 0.01))  # starts while the swap waits: goes after it
    await asyncio.gather(first, swapper, late)
    assert log == ["a+", "a-", "swap+", "swap-", "b+", "b-"]


def test_expert_episode_has_the_agent_loops_layout(chat_dir: Path) -> None:
    """The warm-up's rendering of an expert episode: model turns (action + EOS) trained on, the
    environment's turns context only, ending on the last model turn; the same text the agent loop
    renders for those actions."""
    import envs
    from envs.frozenlake import expert_actions
    from rollout.agent import expert_episode

    engine = TorchEngine(chat_dir, max_batch=2)
    tok = engine.tokenizer
    actions = expert_actions(3)
    env = envs.make_env("frozenlake", prompt="", reference="", size=4)
    prompt, target, mask = expert_episode(tok, True, env, 3, actions, end_of_turn_id=tok.eos_token_id,
                                          limits=AgentLimits(max_turns=20, max_context_tokens=4000))
    assert len(target) == len(mask) and mask[-1] == 1
    spans = turn_spans(mask)
    assert len(spans) == len(actions)
    for (a, b), action in zip(spans, actions, strict=True):
        assert tok.decode(target[a:b - 1]) == action and target[b - 1] == tok.eos_token_id
    text = tok.decode(prompt + target)
    assert "You moved" in text and text.count("<|im_start|>user") == len(actions)
    # limits: fewer turns, and a context too small for any turn gives no target at all
    _, _, m2 = expert_episode(tok, True, envs.make_env("frozenlake", prompt="", reference="", size=4), 3, actions,
                               end_of_turn_id=tok.eos_token_id, limits=AgentLimits(max_turns=2, max_context_tokens=4000))
    assert len(turn_spans(m2)) == 2
    _, t3, m3 = expert_episode(tok, True, envs.make_env("frozenlake", prompt="", reference="", size=4), 3, actions,
                               end_of_turn_id=tok.eos_token_id, limits=AgentLimits(max_context_tokens=len(prompt)))
    assert t3 == [] and m3 == []


def test_window_messages_keep_the_first_exchange_and_the_last_k_turns() -> None:
    from rollout.agent import window_messages

    obs, acts = ["o0", "o1", "o2", "o3", "o4"], ["a0", "a1", "a2", "a3"]

    def seen(k: int, t: int) -> list[str]:
        return [m["content"] for m in window_messages(obs[: t + 1], acts[:t], k, system_prompt="sys")]

    assert seen(0, 0) == ["sys", "o0"]
    assert seen(0, 1) == ["sys", "o0", "a0", "o1"]  # nothing dropped yet
    assert seen(0, 4) == ["sys", "o0", "a0", "o4"]
    assert seen(1, 4) == ["sys", "o0", "a0", "o3", "a3", "o4"]
    assert seen(2, 4) == ["sys", "o0", "a0", "o2", "a2", "o3", "a3", "o4"]
    assert seen(9, 4) == ["sys", "o0", "a0", "o1", "a1", "o2", "a2", "o3", "a3", "o4"]  # the whole conversation
    roles = [m["role"] for m in window_messages(obs, acts, 1)]
    assert roles == ["user", "assistant", "user", "assistant", "user"]  # alternating, no system without one
    with pytest.raises(ValueError, match="one more observation"):
        window_messages(obs, acts[:2], 0)


@pytest.mark.parametrize("chat", [True, False])
async def test_a_windowed_episode_is_one_segment_per_turn_each_scored_on_its_own(chat_dir: Path, chat: bool) -> None:
    """With a history window every turn's prompt is its window rendered afresh (loss 0), its reply
    the sampled tokens (loss 1); the trainer, splitting the episode at ``segment_starts``, gives
    every reply token the logprob the engine sampled it with, and turns attend only to their window."""
    from rollout.agent import window_prompt
    from trainer.batch import segment_layout, split_rows

    engine = TorchEngine(chat_dir, max_batch=4, seed=3)
    engine.chat = chat
    limits = AgentLimits(max_turns=5, max_tokens_per_turn=6, history_turns=1)
    traj = await episode(engine, limits, length=4)
    assert traj.finish == "terminated" and traj.num_turns == 4 and traj.step_rewards == [0.5] * 4
    assert len(traj.segment_starts) == 3 and len(turn_spans(traj.loss_mask)) == 4
    bounds = [0, *traj.segment_starts, len(traj.response_ids)]
    system = SYSTEM if chat else ""
    for t in range(1, 4):
        seg = traj.response_ids[bounds[t]: bounds[t + 1]]
        mask = traj.loss_mask[bounds[t]: bounds[t + 1]]
        prompt = window_prompt(engine.tokenizer, chat, traj.observations[: t + 1], traj.actions[:t], 1, system)
        assert seg[: len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * (len(seg) - len(prompt))
    if chat:  # turn 3 sees the first exchange and turn 2, not turn 1
        text = engine.tokenizer.decode(traj.response_ids[bounds[3]: bounds[4]])
        assert "start 7" in text and "room 2" in text and "room 3" in text and "room 1" not in text
    strategy = TorchStrategy(chat_dir, temperature=1.0, micro_batch_size=2)
    sample = TrainSample(traj.prompt_ids, traj.response_ids, traj.logprobs, traj.loss_mask, 1.0, group_id="g",
                         segment_starts=tuple(traj.segment_starts))
    layout = segment_layout([sample])
    assert layout is not None and len(layout) == 4
    rows = split_rows(collate([sample], strategy.pad_id), layout)
    mask_rows = rows.loss_mask.bool()
    assert int(mask_rows.sum()) == sum(traj.loss_mask)
    # each window's decode steps vs its row in the trainer's pass: rounding only (terms: the hidden size)
    assert_close(strategy.logprobs(rows)[mask_rows], rows.old_logprobs[mask_rows], strategy.model.config.hidden_size)
    # read as one sequence instead, later turns would see tokens their window does not hold
    whole = collate([sample], strategy.pad_id)
    late = whole.loss_mask.bool().clone()
    late[0, : len(traj.prompt_ids) + bounds[1]] = False
    assert not torch.allclose(strategy.logprobs(whole)[late], whole.old_logprobs[late], atol=1e-4)


async def test_a_window_that_does_not_fit_ends_the_episode_on_context(chat_dir: Path) -> None:
    """``max_context_tokens`` bounds each turn's window and reply, not the episode: a window of
    every turn outgrows it, a window of none keeps playing."""
    engine = TorchEngine(chat_dir, max_batch=2, seed=4)
    probe = await episode(engine, AgentLimits(max_turns=1, max_tokens_per_turn=6), length=20)
    context = len(probe.prompt_ids) + 60
    growing = await episode(engine, AgentLimits(max_turns=15, max_tokens_per_turn=6, max_context_tokens=context,
                                                 history_turns=20), length=20)
    assert growing.finish == "context" and 2 <= growing.num_turns < 15
    starts = [0, *growing.segment_starts, len(growing.response_ids)]
    assert all(b - a <= context for a, b in pairwise(starts[1:]))
    steady = await episode(engine, AgentLimits(max_turns=15, max_tokens_per_turn=6, max_context_tokens=context,
                                                history_turns=0), length=20)
    assert steady.finish == "max_turns" and steady.num_turns == 15
    assert len(steady.prompt_ids) + len(steady.response_ids) > context  # the episode itself is longer


def test_expert_windows_render_each_turn_as_the_loop_does(chat_dir: Path) -> None:
    import envs
    from envs.frozenlake import expert_actions
    from rollout.agent import expert_windows, window_prompt

    tok = TorchEngine(chat_dir, max_batch=2).tokenizer
    actions = expert_actions(3)
    env = envs.make_env("frozenlake", prompt="", reference="", size=4)
    turns = expert_windows(tok, True, env, 3, actions, end_of_turn_id=tok.eos_token_id, system_prompt=SYSTEM,
                           limits=AgentLimits(max_turns=20, max_context_tokens=4000, history_turns=0))
    assert len(turns) == len(actions)
    replay = envs.make_env("frozenlake", prompt="", reference="", size=4)
    observations = [replay.reset(seed=3)[0]]
    for t, ((prompt, target), action) in enumerate(zip(turns, actions, strict=True)):
        assert prompt == window_prompt(tok, True, observations, list(actions[:t]), 0, SYSTEM)
        assert tok.decode(target[:-1]) == action and target[-1] == tok.eos_token_id
        observations.append(replay.step(action).observation)
    short = expert_windows(tok, True, envs.make_env("frozenlake", prompt="", reference="", size=4), 3, actions,
                           end_of_turn_id=tok.eos_token_id,
                           limits=AgentLimits(max_turns=2, max_context_tokens=4000, history_turns=0))
    assert len(short) == 2


class Frames:
    """Shows a 56-pixel frame (a 2 x 2 lake, the player on cell ``turn % 4``) with every observation;
    ends after ``length`` turns. ``broken``: its images are not images."""

    def __init__(self, length: int = 3, broken: bool = False, **_: Any) -> None:
        self.length, self.broken, self.t = length, broken, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.t = 0
        return "go", {}

    def step(self, action: str) -> StepResult:
        self.t += 1
        return StepResult("ok", 0.25, self.t >= self.length, False, {})

    def observation_images(self) -> tuple[bytes, ...]:
        from envs.frozenlake_pixels import draw_lake
        from envs.vision import png_bytes

        return (b"not a png",) if self.broken else (png_bytes(draw_lake(("SF", "FG"), self.t % 4, 28)),)


async def test_an_episode_showing_images_gets_the_same_logprobs_from_the_trainer(vlm_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """A visual environment's images (one per observation) go to the blob store, into the turns'
    prompts and the engine's prefill; the trainer, fed the generation's digests, recomputes the
    behaviour logprobs of every turn; an undecodable image ends the episode as an env error."""
    import dataclasses

    from blobs import BlobStore
    from schemas import events as ev
    from services.rollout_worker import generation_of
    from trainer.batch import samples_from_scored

    store = BlobStore(tmp_path / "blobs")
    eng = TorchEngine(vlm_dir, max_batch=2, seed=3)

    async def load(hashes: list[str]) -> Any:
        return eng.image_inputs([store.get(h) for h in hashes], hashes)

    def play(**kw: Any) -> Any:
        return run_episode(eng, eng.tokenizer, LocalEnvClient(lambda name, prompt="", reference="", **k: Frames(**k),
                                                              store),
                           episode_id="v1", env="frames", env_kwargs=kw, seed=0,
                           params=SamplingParams(max_new_tokens=2, temperature=1.0),
                           limits=AgentLimits(max_turns=3, max_tokens_per_turn=2, max_context_tokens=64), images=load)

    traj = await play()
    image_id = eng.model.config.image_token_id
    ids = traj.prompt_ids + traj.response_ids
    assert traj.num_turns >= 2 and len(traj.image_hashes) >= 2  # a later turn's image is in the sequence
    assert ids.count(image_id) == 4 * len(traj.image_hashes) and traj.prompt_ids.count(image_id) == 4
    assert all(store.has(h) for h in traj.image_hashes) and len(set(traj.image_hashes)) == len(traj.image_hashes)

    task = ev.RolloutTask(run_id="r", sample_id="g0/0", group_id="g0", index=0, group_size=1, prompt_id="frames:0",
                          domain="see", prompt="", reference="")
    gen = generation_of(task, traj, "v1", "w0", eng.tokenizer, queued_s=0.0)
    assert gen.image_hashes == traj.image_hashes
    (sample,) = samples_from_scored([ev.ScoredSample(run_id="r", generation=gen, reward=1.0)])
    strat = TorchStrategy(vlm_dir, blob_dir=store.root)
    batch, _ = strat.prepare([sample])
    lp = strat.logprobs(batch)  # (1, L - 1)
    mask = batch.loss_mask > 0
    assert int(mask.sum()) == sum(traj.loss_mask) > 0
    assert_close(lp[mask], batch.old_logprobs[mask], strat.hf_model.config.text_config.hidden_size)
    # the later images matter: with the first frame in their place the trainer's logprobs differ beyond that
    first = (sample.image_hashes[0],) * len(sample.image_hashes)
    swapped, _ = strat.prepare([dataclasses.replace(sample, image_hashes=first)])
    assert float((strat.logprobs(swapped)[mask] - lp[mask]).abs().max()) > 1e-4

    broken = await play(broken=True)
    assert broken.finish == "env_error" and broken.num_turns == 0 and broken.image_hashes == []
    assert "image unusable: blob" in broken.error and "not a decodable image" in broken.error


def test_expert_episode_of_a_visual_environment_carries_its_images(vlm_dir: Path) -> None:
    """The warm-up's expert episode shows the images the environment showed, placeholders expanded;
    with ``frames: first`` only the first observation's."""
    import envs
    from blobs import decode_image, pixel_inputs
    from rollout.agent import expert_episode
    from rollout.model_init import load_tokenizer
    from rollout.vlm import load_image_processor

    tok, processor = load_tokenizer(vlm_dir), load_image_processor(vlm_dir)
    image_id = int(tok.convert_tokens_to_ids("<|image_pad|>"))

    def grid(images: Any) -> torch.Tensor:
        return pixel_inputs(processor, [decode_image(b) for b in images])[1]

    actions = envs.frozenlake.expert_actions(11, size=4)
    for frames, shown in (("every", len(actions)), ("first", 1)):
        env = envs.make_env("frozenlake_pixels", prompt="", reference="", size=4, cell_px=14, frames=frames)
        images: list[bytes] = []
        prompt, target, mask = expert_episode(tok, True, env, 11, actions, end_of_turn_id=tok.eos_token_id,
                                              image_grid=grid, images=images)
        assert len(images) == shown and (prompt + target).count(image_id) == 4 * shown
        assert prompt.count(image_id) == 4 and sum(mask) > 0
    with pytest.raises(ValueError, match="needs image_grid and images"):
        expert_episode(tok, True, env, 11, actions, end_of_turn_id=tok.eos_token_id)


@pytest.mark.parametrize("history", [0, 1])
async def test_a_windowed_episode_showing_images_gets_the_same_logprobs_per_segment(vlm_dir: Path, tmp_path: Path,
                                                                                     history: int) -> None:
    """History windows with a frame every observation: each turn's window shows the frames of the
    observations it holds (the first, the last ``history`` ones, the current one), its request carries
    exactly those, and the generation records every segment's digests; the trainer, splitting the
    episode into one row per segment, feeds each row its own segment's frames and recomputes the
    behaviour logprobs of every turn; with one segment's frames swapped only that row's logprobs move."""
    import dataclasses

    from blobs import BlobStore, sha256_hex
    from envs.frozenlake_pixels import draw_lake
    from envs.vision import png_bytes
    from rollout.agent import window_observations
    from schemas import events as ev
    from schemas.sanity import check_generation
    from services.rollout_worker import generation_of
    from trainer.batch import samples_from_scored, segment_layout

    store = BlobStore(tmp_path / "blobs")
    eng = TorchEngine(vlm_dir, max_batch=2, seed=3)
    requested: list[list[str]] = []

    async def load(hashes: list[str]) -> Any:
        return eng.image_inputs([store.get(h) for h in hashes], hashes)

    generate = eng.generate

    def spy(reqs: list[Any]) -> Any:  # the images each turn's request carries (their grids' count)
        requested.append([str(len(r.images.grid_thw)) if r.images is not None else "0" for r in reqs])
        return generate(reqs)

    eng.generate = spy  # type: ignore[method-assign]
    traj = await run_episode(eng, eng.tokenizer, LocalEnvClient(lambda name, prompt="", reference="", **k: Frames(**k),
                                                                store),
                             episode_id="w1", env="frames", env_kwargs={"length": 4}, seed=0,
                             params=SamplingParams(max_new_tokens=2, temperature=1.0),
                             limits=AgentLimits(max_turns=4, max_tokens_per_turn=2, max_context_tokens=256,
                                                history_turns=history), images=load)
    frame = [sha256_hex(png_bytes(draw_lake(("SF", "FG"), t % 4, 28))) for t in range(4)]
    assert traj.num_turns == 4 and len(traj.segment_starts) == 3 and traj.finish == "terminated"
    windows = [[frame[j] for j in window_observations(t, history)] for t in range(4)]
    assert traj.segment_image_hashes == windows
    assert traj.image_hashes == [h for w in windows for h in w]
    assert requested == [[str(len(w))] for w in windows]
    image_id = eng.model.config.image_token_id
    ids = traj.prompt_ids + traj.response_ids
    bounds = [0, *(len(traj.prompt_ids) + s for s in traj.segment_starts), len(ids)]
    assert [ids[a:b].count(image_id) for a, b in pairwise(bounds)] == [4 * len(w) for w in windows]

    task = ev.RolloutTask(run_id="r", sample_id="g0/0", group_id="g0", index=0, group_size=1, prompt_id="frames:0",
                          domain="see", prompt="", reference="")
    gen = generation_of(task, traj, "w1", "w0", eng.tokenizer, queued_s=0.0)
    assert gen.segment_image_hashes == windows and check_generation(gen) is None
    (sample,) = samples_from_scored([ev.ScoredSample(run_id="r", generation=gen, reward=1.0)])
    assert sample.segment_image_hashes == tuple(tuple(w) for w in windows)
    strat = TorchStrategy(vlm_dir, blob_dir=store.root, micro_batch_size=2)
    batch, _ = strat.prepare([sample])
    layout = segment_layout([sample])
    assert layout is not None and batch.num_rows == len(layout) == 4
    lp = strat.logprobs(batch)  # (4, W - 1): one row per segment
    mask = batch.loss_mask > 0
    assert int(mask.sum()) == sum(traj.loss_mask) and all(bool(m.any()) for m in mask)
    hidden = strat.hf_model.config.text_config.hidden_size
    for r in range(4):  # every segment's decode steps vs its row: rounding only
        assert_close(lp[r][mask[r]], batch.old_logprobs[r][mask[r]], hidden)
    # the last segment shown the first frame in place of its own: that row differs, the others do not
    last = list(sample.segment_image_hashes)
    last[-1] = (frame[0],) * len(last[-1])
    swapped, _ = strat.prepare([dataclasses.replace(sample, segment_image_hashes=tuple(last))])
    moved = strat.logprobs(swapped)
    assert float((moved[3][mask[3]] - lp[3][mask[3]]).abs().max()) > 1e-4
    assert torch.equal(moved[:3][mask[:3]], lp[:3][mask[:3]])
    # a windowed sample whose segments' images are unknown is refused, not fed every image
    with pytest.raises(ValueError, match="no segment_image_hashes"):
        strat.prepare([dataclasses.replace(sample, segment_image_hashes=())])


def test_expert_windows_of_a_visual_environment_carry_each_windows_images(vlm_dir: Path) -> None:
    """The warm-up's windowed expert episode: every turn's prompt is its window rendered as the loop
    renders it (the window's frames' placeholders expanded), with the frames its window shows."""
    import envs
    from blobs import decode_image, pixel_inputs
    from envs.base import observation_images
    from rollout.agent import expert_windows, window_observations, window_prompt
    from rollout.model_init import load_tokenizer
    from rollout.vlm import load_image_processor

    tok, processor = load_tokenizer(vlm_dir), load_image_processor(vlm_dir)
    image_id = int(tok.convert_tokens_to_ids("<|image_pad|>"))

    def grid(images: Any) -> torch.Tensor:
        return pixel_inputs(processor, [decode_image(b) for b in images])[1]

    actions = envs.frozenlake.expert_actions(11, size=4)
    limits = AgentLimits(max_turns=20, max_context_tokens=4000, history_turns=1)
    def lake(frames: str = "every") -> Any:
        return envs.make_env("frozenlake_pixels", prompt="", reference="", size=4, cell_px=14, frames=frames)

    for frames in ("every", "first"):

        shown: list[tuple[bytes, ...]] = []
        turns = expert_windows(tok, True, lake(frames), 11, actions, end_of_turn_id=tok.eos_token_id, limits=limits,
                               image_grid=grid, images=shown)
        assert len(turns) == len(actions) == len(shown)
        replay = lake(frames)
        observations, pictures = [replay.reset(seed=11)[0]], [observation_images(replay)]
        for t, ((prompt, target), action) in enumerate(zip(turns, actions, strict=True)):
            want = tuple(b for j in window_observations(t, 1) for b in pictures[j])
            assert shown[t] == want and prompt.count(image_id) == 4 * len(want)
            assert prompt == window_prompt(tok, True, observations, list(actions[:t]), 1, "",
                                           [grid(p) if p else None for p in pictures])
            assert tok.decode(target[:-1]) == action
            observations.append(replay.step(action).observation)
            pictures.append(observation_images(replay))
        assert all(len(s) == (1 if frames == "first" else min(t + 1, 3)) for t, s in enumerate(shown))
    with pytest.raises(ValueError, match="needs image_grid and images"):
        expert_windows(tok, True, lake(), 11, actions, end_of_turn_id=tok.eos_token_id, limits=limits)
