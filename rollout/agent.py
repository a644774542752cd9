"""The agent loop: one multi-turn episode of a policy in an environment, as one token sequence.

:func:`run_episode` alternates model turns and environment turns until the environment ends the
episode or a limit is reached:

* turn 0: ``client.reset`` gives the first observation, rendered as the first user turn (after the
  system prompt) through the chat template with the generation prompt (:class:`Turns`);
* a model turn is one engine request over the conversation so far; its tokens are trained on
  (``loss_mask`` 1, behaviour logprobs) and its decoded text is the action;
* an environment turn: ``client.step`` gives the next observation; its tokens (the template's text
  between the model's turn and the next generation prompt) are context only (``loss_mask`` 0);
* limits: ``max_turns``, ``max_tokens_per_turn``, and ``max_context_tokens`` (and the model's
  positions) for the whole sequence; an observation that does not fit ends it (``finish="context"``);
* every turn records its weights versions and its reward (:attr:`Trajectory.step_rewards`; the
  return is their sum); an environment error ends it (``finish="env_error"``), keeping the turns.

Images (a vision-language policy): an observation may show images (``Observation.image_hashes``,
digests in the run's blob store); ``run_episode``'s ``images`` loader reads them and runs them
through the engine's image processor, the observation's user turn holds their placeholders
(expanded to the images' token counts), and every later model turn's request carries every image
shown so far (:attr:`Trajectory.image_hashes`, in order). An image that cannot be loaded ends the
episode as an environment error.

With ``history_turns = k`` every model turn gets a prompt of its own from a window of the
conversation (:func:`window_messages`); the episode is then one segment per turn
(:attr:`Trajectory.segment_starts`). A window shows the images of the observations it holds
(:func:`window_observations`; each observation's images are loaded once per episode), each turn's
request carries exactly those, and :attr:`Trajectory.segment_image_hashes` records every segment's.
Turns are found by text deltas of the rendered conversation, so any prefix-stable chat template
works; the model's tokens are kept exactly as sampled.
Design: docs/architecture.md, "Engines and strategies" (the agent loop); docs/agentic.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch

from rollout.engine import Engine, GenerationRequest
from rollout.sampling import SamplingParams
from rollout.vlm import IMAGE_PAD, ImageInputs, expand_image_tokens, join_images

Finish = Literal["terminated", "truncated", "max_turns", "context", "env_error", "cancelled"]


@dataclass(frozen=True)
class AgentLimits:
    """Limits of one episode."""

    max_turns: int = 8
    """Model turns at most."""
    max_tokens_per_turn: int = 32
    """Generated tokens per model turn at most."""
    max_context_tokens: int = 1024
    """Prompt plus every turn, tokens at most (with ``history_turns``: per turn, its window's prompt
    plus its reply)."""
    history_turns: int | None = None
    """``None``: the episode is one growing sequence. ``k >= 0``: every turn sees only a window of the
    conversation, the first exchange and the last ``k`` turns (see the module doc)."""


@dataclass(frozen=True)
class Observation:
    """What the environment answered to a reset or a step."""

    text: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Non-empty: the environment failed on this step (crash, timeout); the episode ends."""
    env_s: float = 0.0
    """Seconds the environment took (simulated latency included)."""
    image_hashes: tuple[str, ...] = ()
    """The images this observation shows (digests in the run's blob store), before its text."""


ImageLoader = Callable[[list[str]], Awaitable[ImageInputs]]
"""``load(digests)``: the images of a vision-language engine (read from the run's blob store, through
its image processor); raises with the reason when one is missing or undecodable."""


class EnvClient(Protocol):
    """How the agent loop reaches an environment (over Kafka in the rollout worker; in-process in tests)."""

    async def reset(self, episode_id: str, env: str, kwargs: dict[str, Any], seed: int) -> Observation: ...

    async def step(self, episode_id: str, step: int, action: str, *, history: list[str],
                   policy_version: int) -> Observation: ...


@dataclass
class Trajectory:
    """One episode as the trainer sees it (a ``Generation`` with per-turn rewards)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    """Model and environment tokens interleaved, after the prompt."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour logprob of each model token; 0.0 on environment tokens."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on model tokens, 0 on environment tokens."""
    step_rewards: list[float] = field(default_factory=list)
    """One reward per model turn."""
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    """Every observation, the reset's first."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(start, end) weights version of every model turn."""
    infos: list[dict[str, Any]] = field(default_factory=list)
    segment_starts: list[int] = field(default_factory=list)
    """History windows: where each model turn's own prompt (after the first turn's) starts in
    ``response_ids``; empty = one sequence."""
    image_hashes: list[str] = field(default_factory=list)
    """Every image the sequence shows (the observations' that entered it), in order (with history
    windows: every segment's, one segment after the other; an image is repeated in every window
    that holds its observation)."""
    segment_image_hashes: list[list[str]] = field(default_factory=list)
    """History windows with images: the images of each segment (the first turn's prompt and reply,
    then one per ``segment_starts``), in order; empty when the episode showed none or is one sequence."""
    finish: Finish = "max_turns"
    last_finish_reason: str = "stop"
    """The engine's finish reason of the last model turn (``stop`` / ``length``)."""
    success: bool = False
    error: str = ""
    gen_s: float = 0.0
    env_s: float = 0.0

    @property
    def num_turns(self) -> int:
        return len(self.actions)

    @property
    def episode_return(self) -> float:
        return float(sum(self.step_rewards))

    @property
    def versions_consistent(self) -> bool:
        """Every turn ran on one weights version (no swap inside a turn)."""
        return all(a == b for a, b in self.versions)


class Turns:
    """Token bookkeeping of a conversation rendered through a chat template (see the module doc)."""

    def __init__(self, tokenizer: Any, chat: bool, system_prompt: str = "") -> None:
        self.tok, self.chat = tokenizer, chat
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def _user(self, observation: str, grid: torch.Tensor | None) -> dict[str, Any]:
        """A user turn: the observation's text, after its images' placeholders when it shows some."""
        if grid is None:
            return {"role": "user", "content": observation}
        if not self.chat:
            raise ValueError("an observation with images needs a chat template (a vision-language model's)")
        return {"role": "user", "content": [*({"type": "image"} for _ in range(len(grid))),
                                            {"type": "text", "text": observation}]}

    def _expand(self, ids: list[int], grid: torch.Tensor | None) -> list[int]:
        """``ids`` with each image placeholder repeated as many times as its image has tokens."""
        if grid is None:
            return ids
        return expand_image_tokens(ids, grid, int(self.tok.convert_tokens_to_ids(IMAGE_PAD)))

    def _render(self, generation_prompt: bool) -> str:
        return str(self.tok.apply_chat_template(self.messages, add_generation_prompt=generation_prompt, tokenize=False))

    def _ids(self, text: str, specials: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=specials)["input_ids"])

    def start(self, observation: str, grid: torch.Tensor | None = None) -> list[int]:
        """Prompt ids: the system turn (if any) and the first observation as the user turn (after
        the placeholders of its images, whose ``grid_thw`` (images, 3) is ``grid``)."""
        user = self._user(observation, grid)
        if not self.chat:
            return self._ids(observation, specials=True)
        self.messages.append(user)
        return self._expand(self._ids(self._render(True), specials=False), grid)

    def after_turn(self, turn_ids: list[int], action: str, observation: str,
                   grid: torch.Tensor | None = None) -> list[int]:
        """The environment's tokens after a model turn (``turn_ids`` as sampled) that answered
        ``action`` and got ``observation`` (showing the images of ``grid``, if any): everything up
        to the next generation prompt."""
        user = self._user(observation, grid)
        if not self.chat:
            return self._ids("\n" + observation + "\n", specials=False)
        # what the template writes after an assistant message's content (its end-of-turn marker),
        # found with a marker as the content so that the action's own text cannot confuse it
        marker = "\x00rollstream-turn-end\x00"
        self.messages.append({"role": "assistant", "content": marker})
        with_marker = self._render(False)
        tail = with_marker[with_marker.rindex(marker) + len(marker):]
        self.messages[-1] = {"role": "assistant", "content": action}
        closed = self._render(False)
        self.messages.append(user)
        opened = self._render(True)
        if not opened.startswith(closed) or not closed.endswith(tail):
            raise ValueError("the chat template is not prefix-stable across turns (rendering a new user turn "
                             "changed the text before it); multi-turn episodes need one that is")
        last = str(self.tok.decode(turn_ids[-1:])) if turn_ids else ""
        if last and tail.startswith(last) and turn_ids[-1] in self.tok.all_special_ids:
            tail = tail[len(last):]  # the model already wrote its end-of-turn token
        return self._expand(self._ids(tail + opened[len(closed):], specials=False), grid)


def window_observations(turn: int, history_turns: int) -> list[int]:
    """Which observations the window of model turn ``turn`` (0-based: ``turn`` actions played so far)
    holds, in order: the first, the last ``history_turns`` before the current one, the current one."""
    if turn == 0:
        return [0]
    return [0, *range(max(1, turn - history_turns), turn), turn]


def window_messages(observations: list[str], actions: list[str], history_turns: int,
                    system_prompt: str = "") -> list[dict[str, str]]:
    """The chat messages a model turn sees under a history window of ``history_turns`` turns.

    ``observations`` are every observation so far (the reset's first, the current one last: one
    more than ``actions``). The window keeps the first observation and reply (the task and how
    the model opened), then the last ``history_turns`` observation/reply pairs before the current
    observation, and the current observation; user and assistant turns alternate as every chat
    template expects. Without dropped turns it is the whole conversation.
    """
    if len(observations) != len(actions) + 1:
        raise ValueError(f"window_messages: {len(observations)} observations for {len(actions)} actions "
                         "(needs one more observation than actions)")
    t = len(actions)
    *keep, _ = window_observations(t, history_turns)  # exchanges (observation j, action j) kept
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for j in keep:
        messages += [{"role": "user", "content": observations[j]}, {"role": "assistant", "content": actions[j]}]
    messages.append({"role": "user", "content": observations[t]})
    return messages


def window_prompt(tokenizer: Any, chat: bool, observations: list[str], actions: list[str], history_turns: int,
                  system_prompt: str = "", grids: Sequence[torch.Tensor | None] | None = None) -> list[int]:
    """Token ids of a model turn's prompt under a history window (:func:`window_messages`): through
    the chat template with the generation prompt, or without one (``chat`` false) the same pieces
    concatenated as the growing sequence has them (first observation, then each reply followed by
    ``"\n" + observation + "\n"``).

    ``grids[j]``: the ``grid_thw`` (images, 3) of the images observation ``j`` shows (None: none).
    The window's observations that show images get their placeholders before their text (as
    :class:`Turns` renders them), expanded to the images' token counts; the prompt shows the
    images of :func:`window_observations`, in that order (a ``ValueError`` without a chat template)."""
    messages: list[dict[str, Any]] = list(window_messages(observations, actions, history_turns, system_prompt))
    kept = window_observations(len(actions), history_turns)
    shown = [g for g in (grids[j] for j in kept) if g is not None] if grids is not None else []
    if shown and not chat:
        raise ValueError("an observation with images needs a chat template (a vision-language model's)")
    if chat:
        if shown:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            for i, j in zip(users, kept, strict=True):
                grid = grids[j] if grids is not None else None
                if grid is not None:
                    messages[i] = {"role": "user", "content": [*({"type": "image"} for _ in range(len(grid))),
                                                               {"type": "text", "text": observations[j]}]}
        text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not shown:
            return ids
        return expand_image_tokens(ids, torch.cat(shown), int(tokenizer.convert_tokens_to_ids(IMAGE_PAD)))
    body = [m["content"] for m in messages if m["role"] != "system"]
    ids = list(tokenizer(body[0], add_special_tokens=True)["input_ids"])
    for action, obs in zip(body[1::2], body[2::2], strict=True):
        ids += list(tokenizer(action + "\n" + obs + "\n", add_special_tokens=False)["input_ids"])
    return ids


async def run_episode(
    engine: Engine,
    tokenizer: Any,
    client: EnvClient,
    *,
    episode_id: str,
    env: str,
    env_kwargs: dict[str, Any],
    seed: int,
    params: SamplingParams,
    limits: AgentLimits = AgentLimits(),
    system_prompt: str = "",
    turn_guard: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None = None,
    cancelled: Callable[[], bool] | None = None,
    images: ImageLoader | None = None,
) -> Trajectory:
    """Play one episode (see the module doc). Never raises for the environment's fault.

    ``turn_guard()`` is entered around every model turn's generation (the rollout worker passes
    :meth:`SwapLock.turn`, so weights are never swapped inside a turn). ``cancelled()`` is asked
    before every model turn: true ends the episode there (``finish="cancelled"``; a redundant
    episode whose group finished without it). ``images`` loads the images observations show (a
    vision-language engine); without it an observation with images ends the episode."""
    guard = turn_guard or contextlib.nullcontext
    turns = Turns(tokenizer, engine.chat, system_prompt)
    windowed = limits.history_turns is not None
    t0 = time.perf_counter()

    async def load(obs: Observation) -> tuple[Observation, ImageInputs | None]:
        """The observation's images; an error observation when they cannot be shown."""
        if obs.error or not obs.image_hashes:
            return obs, None
        try:
            if images is None:
                raise ValueError("the environment shows images but the policy is not a vision-language model")
            return obs, await images(list(obs.image_hashes))
        except Exception as e:
            return replace(obs, error=f"image unusable: {e}"), None

    try:
        first = await client.reset(episode_id, env, env_kwargs, seed)
    except Exception as e:  # the client itself failed (timeout waiting for the env worker, ...)
        first = Observation("", error=f"reset failed: {type(e).__name__}: {e}")
    first, shown = await load(first)
    try:
        prompt_ids = turns.start(first.text, shown.grid_thw if shown is not None else None) if not first.error else []
    except ValueError as e:  # placeholders and images disagree, no chat template for images
        first, prompt_ids = replace(first, error=f"image unusable: {e}"), []
    traj = Trajectory(prompt_ids=prompt_ids, env_s=first.env_s)
    if shown is not None:
        traj.image_hashes += first.image_hashes
    traj.observations.append(first.text)
    traj.infos.append(dict(first.info))
    if first.error:
        traj.finish, traj.error = "env_error", first.error
        return traj
    # history windows: every observation's images (loaded once, shown by every window holding it)
    pictures: list[ImageInputs | None] = [shown]
    digests: list[tuple[str, ...]] = [first.image_hashes if shown is not None else ()]
    if windowed:
        traj.segment_image_hashes.append(list(digests[0]))
    # the model's own position limit bounds the context too (the engine refuses longer prompts)
    context = min(limits.max_context_tokens, int(getattr(engine, "max_positions", limits.max_context_tokens)))
    prompt = list(traj.prompt_ids)  # what the next model turn reads: everything so far, or its window
    for step in range(1, limits.max_turns + 1):
        if cancelled is not None and cancelled():
            traj.finish = "cancelled"
            break
        room = min(limits.max_tokens_per_turn, context - len(prompt))
        if room < 1:
            traj.finish = "context"
            break
        req = GenerationRequest(f"{episode_id}/t{step}", prompt, replace(params, max_new_tokens=room), images=shown)
        completion = None
        async with guard():
            async for c in engine.generate([req]):
                completion = c
        assert completion is not None
        if completion.error:
            raise RuntimeError(f"engine error: {completion.error}")
        traj.gen_s += completion.gen_s
        traj.versions.append((completion.policy_version, completion.policy_version_end))
        traj.response_ids += completion.token_ids
        traj.logprobs += completion.logprobs
        traj.loss_mask += [1] * len(completion.token_ids)
        traj.last_finish_reason = completion.finish_reason
        action = completion.text
        traj.actions.append(action)
        try:
            obs = await client.step(episode_id, step, action, history=traj.actions[:-1],
                                    policy_version=completion.policy_version)
        except Exception as e:
            obs = Observation("", error=f"step failed: {type(e).__name__}: {e}")
        traj.env_s += obs.env_s
        traj.step_rewards.append(float(obs.reward))
        traj.observations.append(obs.text)
        traj.infos.append(dict(obs.info))
        if obs.error:
            traj.finish, traj.error = "env_error", obs.error
            break
        if obs.terminated or obs.truncated:
            traj.finish = "terminated" if obs.terminated else "truncated"
            traj.success = bool(obs.info.get("success", False))
            break
        if step == limits.max_turns:
            traj.finish = "max_turns"
            break
        obs, seen = await load(obs)
        if obs.error:
            traj.finish, traj.error = "env_error", obs.error
            break
        if windowed:
            assert limits.history_turns is not None
            pictures.append(seen)
            digests.append(obs.image_hashes if seen is not None else ())
            try:
                env_ids = window_prompt(tokenizer, engine.chat, traj.observations, traj.actions, limits.history_turns,
                                        system_prompt, [p.grid_thw if p is not None else None for p in pictures])
            except ValueError as e:
                if not any(p is not None for p in pictures):
                    raise  # the chat template, not an image
                traj.finish, traj.error = "env_error", f"image unusable: {e}"
                break
            if len(env_ids) >= context:
                traj.finish = "context"
                break
            kept = window_observations(len(traj.actions), limits.history_turns)
            shown = None
            for j in kept:
                if (picture := pictures[j]) is not None:
                    shown = join_images(shown, picture)
            traj.segment_starts.append(len(traj.response_ids))
            traj.segment_image_hashes.append([h for j in kept for h in digests[j]])
            prompt = list(env_ids)
        else:
            try:
                env_ids = turns.after_turn(completion.token_ids, action, obs.text,
                                           seen.grid_thw if seen is not None else None)
            except ValueError as e:
                if seen is None:
                    raise  # the chat template, not an image
                traj.finish, traj.error = "env_error", f"image unusable: {e}"
                break
            if len(prompt) + len(completion.token_ids) + len(env_ids) >= context:
                traj.finish = "context"
                break
            prompt = prompt + list(completion.token_ids) + env_ids
            if seen is not None:
                shown = join_images(shown, seen)
                traj.image_hashes += obs.image_hashes
        traj.response_ids += env_ids
        traj.logprobs += [0.0] * len(env_ids)
        traj.loss_mask += [0] * len(env_ids)
    if not any(traj.segment_image_hashes):
        traj.segment_image_hashes = []  # no images (a text episode's events stay as they were)
    if windowed:
        traj.image_hashes = [h for seg in traj.segment_image_hashes for h in seg]
    traj.gen_s = traj.gen_s or (time.perf_counter() - t0 - traj.env_s)
    return traj


class SwapLock:
    """Keeps weight swaps out of agent turns: any number of turns at once, or one swap.

    A swap waits for the turns in progress to end; turns that start while a swap waits wait for it
    (the swap is never starved by a stream of overlapping turns, and a turn is short: at most
    ``max_new_tokens`` tokens)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._turns = 0
        self._swapping = False
        self._swaps_waiting = 0

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping and not self._swaps_waiting)
            self._turns += 1
        try:
            yield
        finally:
            async with self._cond:
                self._turns -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def swap(self) -> AsyncIterator[None]:
        async with self._cond:
            self._swaps_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._swapping and self._turns == 0)
            finally:
                self._swaps_waiting -= 1
            self._swapping = True
        try:
            yield
        finally:
            async with self._cond:
                self._swapping = False
                self._cond.notify_all()


def env_images(env: Any) -> tuple[bytes, ...]:
    """The images (PNG bytes) of a visual environment's latest observation (its
    ``observation_images()``, as :func:`envs.base.observation_images`); ``()`` for a text one."""
    shown = getattr(env, "observation_images", None)
    return tuple(bytes(b) for b in shown()) if callable(shown) else ()


class LocalEnvClient:
    """An :class:`EnvClient` that runs registered environments in this process (tests, offline
    benchmarks, the trainer's evaluation); the env workers serve the same protocol over Kafka. A
    visual environment's images go to ``blobs`` (a :class:`blobs.BlobStore`) as the env workers'
    do; without one such an observation is an error."""

    def __init__(self, make_env: Any, blobs: Any = None) -> None:
        self._make = make_env
        self.blobs = blobs
        self.episodes: dict[str, Any] = {}

    def _stored(self, instance: Any) -> tuple[str, ...]:
        shown = env_images(instance)
        if shown and self.blobs is None:
            raise ValueError("the environment shows images but this client has no blob store")
        return tuple(self.blobs.put(b) for b in shown)

    async def reset(self, episode_id: str, env: str, kwargs: dict[str, Any], seed: int) -> Observation:
        try:
            instance = self._make(env, prompt="", reference="", **kwargs)
            text, info = instance.reset(seed)
            hashes = self._stored(instance)
        except Exception as e:
            return Observation("", error=f"{type(e).__name__}: {e}", terminated=True)
        self.episodes[episode_id] = instance
        return Observation(text, info=dict(info), image_hashes=hashes)

    async def step(self, episode_id: str, step: int, action: str, *, history: list[str],
                   policy_version: int) -> Observation:
        instance = self.episodes.get(episode_id)
        if instance is None:
            return Observation("", error=f"unknown episode {episode_id}", terminated=True)
        try:
            res = instance.step(action)
            hashes = self._stored(instance)
        except Exception as e:
            return Observation("", error=f"{type(e).__name__}: {e}", terminated=True)
        return Observation(res.observation, reward=float(res.reward), terminated=bool(res.terminated),
                           truncated=bool(res.truncated), info=dict(res.info), image_hashes=hashes)


def _grid_reader(image_grid: Callable[[Sequence[bytes]], torch.Tensor] | None, images: list[Any] | None,
                 who: str) -> Callable[[tuple[bytes, ...]], torch.Tensor | None]:
    """An expert episode's ``grid_of(shown)``: the ``grid_thw`` of an observation's images (None for
    none); a ``ValueError`` naming ``who`` when the environment shows images and no processor is given."""

    def grid_of(shown: tuple[bytes, ...]) -> torch.Tensor | None:
        if not shown:
            return None
        if image_grid is None or images is None:
            raise ValueError(f"the environment shows images: {who} needs image_grid and images")
        return image_grid(shown)

    return grid_of


def expert_episode(
    tokenizer: Any,
    chat: bool,
    env: Any,
    seed: int,
    actions: list[str],
    *,
    end_of_turn_id: int,
    system_prompt: str = "",
    limits: AgentLimits = AgentLimits(),
    image_grid: Callable[[Sequence[bytes]], torch.Tensor] | None = None,
    images: list[bytes] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """An expert's episode as the agent loop would have produced it, for the supervised warm-up:
    ``(prompt_ids, target_ids, target_mask)``.

    ``env`` (a fresh environment) is reset with ``seed`` and the ``actions`` are played in order;
    each model turn is the action's tokens plus ``end_of_turn_id`` (what ends a turn in rollout:
    an EOS token) with mask 1, each environment turn the tokens :class:`Turns` renders, mask 0 —
    the same layout :func:`run_episode` produces. It stops when the episode ends, after
    ``limits.max_turns`` turns, or where the next turn would not fit in ``limits.max_context_tokens``.

    A visual environment (:func:`env_images`): ``image_grid(images)`` gives their ``grid_thw`` (a
    vision-language policy's processor; required then), and the images the returned tokens show
    are appended to ``images``, in order.
    """
    turns = Turns(tokenizer, chat, system_prompt)

    grid_of = _grid_reader(image_grid, images, "expert_episode")

    text, _ = env.reset(seed=seed)
    shown = env_images(env)
    prompt = turns.start(text, grid_of(shown))
    if images is not None:
        images += shown
    target: list[int] = []
    mask: list[int] = []
    later: list[tuple[int, int]] = []  # (where an observation's tokens start in target, its images)
    for i, action in enumerate(actions[: limits.max_turns]):
        turn_ids = [*tokenizer(action, add_special_tokens=False)["input_ids"], end_of_turn_id]
        if len(prompt) + len(target) + len(turn_ids) > limits.max_context_tokens:
            break
        target += turn_ids
        mask += [1] * len(turn_ids)
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated or i + 1 == len(actions):
            break
        shown = env_images(env)
        env_ids = turns.after_turn(turn_ids, action, obs, grid_of(shown))
        if shown and images is not None:
            later.append((len(target), len(shown)))
            images += shown
        target += env_ids
        mask += [0] * len(env_ids)
    while mask and mask[-1] == 0:  # never end on environment tokens
        target.pop()
        mask.pop()
    while later and later[-1][0] >= len(target) and images is not None:  # their observation was cut off too
        del images[len(images) - later.pop()[1]:]
    return prompt, target, mask


def expert_windows(
    tokenizer: Any,
    chat: bool,
    env: Any,
    seed: int,
    actions: list[str],
    *,
    end_of_turn_id: int,
    limits: AgentLimits,
    system_prompt: str = "",
    image_grid: Callable[[Sequence[bytes]], torch.Tensor] | None = None,
    images: list[tuple[bytes, ...]] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """An expert's episode under the history window of ``limits.history_turns``, for the supervised
    warm-up: one ``(prompt_ids, target_ids)`` per model turn, the prompt rendered as
    :func:`run_episode` renders it (:func:`window_prompt`), the target the action's tokens plus
    ``end_of_turn_id``. It stops when the episode ends, after ``limits.max_turns`` turns, or at the
    first turn whose window and action would not fit in ``limits.max_context_tokens``.

    A visual environment (:func:`env_images`): ``image_grid(images)`` gives their ``grid_thw`` (a
    vision-language policy's processor; required then), and for every returned turn the images its
    window shows (:func:`window_observations`, in order) are appended to ``images``."""
    history_turns = limits.history_turns
    if history_turns is None:
        raise ValueError("expert_windows needs limits.history_turns (use expert_episode for one sequence)")

    grid_of = _grid_reader(image_grid, images, "expert_windows")

    text, _ = env.reset(seed=seed)
    pictures: list[tuple[bytes, ...]] = [env_images(env)]
    grids = [grid_of(pictures[0])]
    observations: list[str] = [text]
    played: list[str] = []
    out: list[tuple[list[int], list[int]]] = []
    for action in actions[: limits.max_turns]:
        prompt = window_prompt(tokenizer, chat, observations, played, history_turns, system_prompt, grids)
        target = [*tokenizer(action, add_special_tokens=False)["input_ids"], end_of_turn_id]
        if len(prompt) + len(target) > limits.max_context_tokens:
            break
        out.append((prompt, target))
        if images is not None:
            images.append(tuple(b for j in window_observations(len(played), history_turns) for b in pictures[j]))
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            break
        observations.append(obs)
        played.append(action)
        pictures.append(env_images(env))
        grids.append(grid_of(pictures[-1]))
    return out


def turn_spans(loss_mask: Iterable[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of every contiguous run of ``loss_mask == 1`` (the model turns), in order."""
    spans: list[tuple[int, int]] = []
    start = -1
    mask = list(loss_mask)
    for i, m in enumerate(mask):
        if m and start < 0:
            start = i
        elif not m and start >= 0:
            spans.append((start, i))
            start = -1
    if start >= 0:
        spans.append((start, len(mask)))
    return spans
