"""The trainer's work that needs no Kafka: model setup, warm-up, evaluation, weights, checkpoints.

:class:`TrainerCore` holds the training backend (:func:`trainer.factory.make_strategy`), the
evaluation engine (:func:`rollout.factory.make_engine`), the version counter, the
buffer of undecided samples (:class:`services.trainer_buffer.GroupBuffer`) and the consumer
positions it covers; :class:`services.trainer_service.Trainer` drives it from the run's topics.

* :meth:`TrainerCore.warm_up` — the supervised warm-up on the task sources' demonstrations
  (``Strategy.warmup``);
* :meth:`TrainerCore.evaluate` — greedy accuracy on every domain's held-out problems (multi-turn
  domains: the success rate of greedy episodes against in-process environments), and with
  ``train.eval_samples`` the mean accuracy of sampled answers or episodes;
* :meth:`TrainerCore.weights_event` — export the weights of the current version to
  ``<run>/weights/v<version>`` and describe them (``WeightsPublished``);
* :meth:`TrainerCore.save_checkpoint` / :meth:`TrainerCore.load_checkpoint` —
  ``<run>/checkpoints/step_<k>``: the strategy's state before step ``k`` plus
  ``stream_state.msgpack`` (version, consumer positions, the undecided buffer, the decided ids
  and the dead-lettered members of open groups).
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch

import envs
from envs.base import episode_ref
from rollout.agent import AgentLimits, LocalEnvClient, Trajectory, expert_episode, expert_windows, run_episode
from rollout.engine import GenerationRequest
from rollout.factory import make_engine
from rollout.model_init import encode_prompt
from rollout.sampling import SamplingParams
from runtime.bus import TopicPartition
from schemas import events as ev
from schemas.config import RunConfig
from schemas.devices import resolve_device
from services.trainer_buffer import GroupBuffer
from trainer.factory import make_strategy
from trainer.sft import SFTExample

log = logging.getLogger("rollstream.trainer")

__all__ = ["StreamState", "TrainerCore", "TrainerSettings"]

KEEP_WEIGHT_VERSIONS = 3
"""Exported weight versions kept on disk (slow rollout workers may still be loading one)."""


class TrainerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of the trainer (one per run)."""

    run_id: str
    """The run to train."""
    config: RunConfig
    """The run config (train, algorithm, rollout.temperature, data for eval)."""
    model_dir: str
    """Initial model (HF directory)."""
    run_dir: str
    """The run directory: weights/, checkpoints/ go below it."""
    device: str = ""
    """Torch device; empty = ``train.device`` of the config, resolved here."""
    poll_timeout_s: float = 0.2
    """Longest wait for scored samples per poll, seconds."""
    eval_batch: int = 64
    """Concurrent sequences of the evaluation engine."""


def format_answer(answer: str, mode: str) -> str:
    """A warm-up demonstration in the answer format its domain rewards: ``<answer>…</answer>`` for
    ``tag`` and ``auto``, ``\\boxed{…}`` for ``boxed``, as it is for ``raw``."""
    if mode in ("tag", "auto"):
        return f"<answer>{answer}</answer>"
    if mode == "boxed":
        return f"\\boxed{{{answer}}}"
    return answer


class StreamState(msgspec.Struct):
    """What a checkpoint keeps of the stream (``stream_state.msgpack``)."""

    step: int
    version: int
    positions: dict[str, int]
    """``topic:partition`` -> next offset to read."""
    buffer: list[ev.ScoredSample]
    """Undecided samples, groups in arrival order."""
    decided: list[str]
    """Sample ids with a terminal status (dead-lettered ones included)."""
    dead: dict[str, list[str]] = {}
    """Open group id -> its dead-lettered members. (Checkpoints before it read as none.)"""


class TrainerCore:
    """Model-side state of the trainer (see the module doc)."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.s = settings
        cfg = self.cfg = settings.config
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.run_dir = Path(settings.run_dir)
        device = settings.device or resolve_device(cfg.train.device, "train.device")
        self.strategy = make_strategy(cfg, settings.model_dir, device=device)
        self.tokenizer = self.strategy.tokenizer
        # the evaluation runs a local torch engine whatever rollout.engine is
        self.eval_engine = make_engine(cfg, settings.model_dir, max_batch=settings.eval_batch,
                                       device=device, seed=cfg.run.seed, policy_version=0, local=True)
        self.sources = [envs.make_source(d.source, **d.kwargs) for d in cfg.data.domains]
        self.heldout = [
            (d, src.heldout(cfg.data.heldout_size), d.verifier or src.default_verifier)
            for d, src in zip(cfg.data.domains, self.sources, strict=True)
        ]
        self.limits = AgentLimits(max_turns=cfg.rollout.max_turns, max_tokens_per_turn=cfg.rollout.max_new_tokens,
                                  max_context_tokens=min(cfg.rollout.max_context_tokens, self.eval_engine.max_positions),
                                  history_turns=cfg.rollout.history_turns)
        self.version = 0
        """The policy version being trained (weights of ``version`` are the latest published)."""
        self.buffer = GroupBuffer()
        self.positions: dict[TopicPartition, int] = {}
        """Next offset to read per consumed partition: what the buffer and ``decided`` cover."""
        self.pool: dict[str, ev.ScoredSample] = {}
        """After a resume: samples of steps an earlier instance trained (on the topic) that this
        one re-runs from their recorded batch (checkpointed with the buffer)."""
        self.last_eval: dict[str, float] = {}

    def close(self) -> None:
        """Release what the training backend holds (a multi-rank strategy's processes); idempotent."""
        close = getattr(self.strategy, "close", None)
        if close is not None:
            close()

    @property
    def decided(self) -> set[str]:
        """Sample ids with a terminal status (the buffer's)."""
        return self.buffer.decided

    # ----------------------------------------------------------------- evaluation

    async def evaluate(self, split: str) -> dict[str, float]:
        """Greedy accuracy on the held-out problems of every domain (``eval/accuracy`` overall,
        ``eval/<domain>/accuracy`` per domain, ``eval/response_len``); with ``train.eval_samples`` k
        > 0 also the mean correctness of k samples per problem at the rollout's temperature and top-p
        (``eval/accuracy_sampled``, ``eval/<domain>/accuracy_sampled``). Both stop where rollout
        stops (``rollout.stop``)."""
        weights = self._weights_dir(self.version)
        if weights.exists():  # before the warm-up there are none yet: the initial model is evaluated
            await self.eval_engine.load_weights(weights, self.version)
        ro = self.cfg.rollout
        greedy = SamplingParams(max_new_tokens=ro.max_new_tokens, greedy=True, stop=tuple(ro.stop))
        metrics: dict[str, float] = {}
        correct, total, length = await self._evaluate_with(greedy, 1, "accuracy", metrics)
        metrics["eval/accuracy"] = correct / max(1, total)
        metrics["eval/response_len"] = length / max(1, total)
        k = self.cfg.train.eval_samples
        if k > 0:
            sampled = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
                                     stop=tuple(ro.stop))
            correct, total, _ = await self._evaluate_with(sampled, k, "accuracy_sampled", metrics)
            metrics["eval/accuracy_sampled"] = correct / max(1, total)
        self.last_eval = metrics
        return metrics

    async def _evaluate_with(self, params: SamplingParams, k: int, name: str,
                             metrics: dict[str, float]) -> tuple[int, int, int]:
        """``k`` answers (or episodes) per held-out problem of every domain with ``params``; sets
        ``eval/<domain>/<name>`` (and, for multi-turn domains in the greedy pass, their return and
        turns). Returns (correct, answers, model tokens generated)."""
        correct = total = length = 0
        reward = self.cfg.reward
        for domain, problems, verifier in self.heldout:
            system = domain.system_prompt or self.cfg.model.system_prompt
            if envs.is_episodic(domain.source):
                ok, tokens = await self._evaluate_episodes(domain.name, problems, system, params, k, name, metrics)
                length += tokens
                correct += ok
                total += k * len(problems)
                continue
            reqs: list[GenerationRequest] = []
            by_id: dict[str, envs.Problem] = {}
            for p in problems:
                prompt_ids = self.eval_engine.encode(p.prompt, system)  # once per problem, shared by its k
                for j in range(k):
                    rid = f"{p.prompt_id}#{j}" if k > 1 else p.prompt_id
                    reqs.append(GenerationRequest(rid, prompt_ids, params))
                    by_id[rid] = p
            done = [c async for c in self.eval_engine.generate(reqs)]
            # as the reward router runs them: bounded by reward.timeout_s, off the event loop (a
            # verifier that hangs or crashes scores 0 and cannot stall the trainer)
            results = await asyncio.gather(*(
                asyncio.to_thread(envs.score_response, verifier, c.text, by_id[c.request_id].reference,
                                  domain.verifier_kwargs, answer=domain.answer, format_reward=domain.format_reward,
                                  timeout_s=reward.timeout_s, isolation=reward.isolation)
                for c in done))
            ok = sum(int(res.correct) for res in results)
            length += sum(len(c.token_ids) for c in done)
            metrics[f"eval/{domain.name}/{name}"] = ok / max(1, len(reqs))
            correct += ok
            total += len(reqs)
        return correct, total, length

    async def _evaluate_episodes(self, domain: str, problems: list[envs.Problem], system: str, params: SamplingParams,
                                 k: int, name: str, metrics: dict[str, float]) -> tuple[int, int]:
        """``k`` episodes of each held-out problem of a multi-turn domain with ``params``, all at once,
        against in-process environments (evaluation needs no environment workers). Metrics:
        ``eval/<domain>/<name>`` (success rate); for the greedy pass also ``eval/<domain>/return`` and
        ``eval/<domain>/turns`` (means). Returns (successes, model tokens generated)."""
        client = LocalEnvClient(envs.make_env)

        async def play(p: envs.Problem, j: int) -> Trajectory:
            ref = episode_ref(p.reference)
            return await run_episode(self.eval_engine, self.eval_engine.tokenizer, client,
                                     episode_id=f"eval/{p.prompt_id}" + (f"#{j}" if k > 1 else ""), env=ref.env,
                                     env_kwargs=ref.kwargs, seed=ref.seed, params=params,
                                     limits=self.limits, system_prompt=system)

        trajs = await asyncio.gather(*(play(p, j) for p in problems for j in range(k)))
        n = max(1, len(trajs))
        ok = sum(int(t.success) for t in trajs)
        metrics[f"eval/{domain}/{name}"] = ok / n
        if name == "accuracy":  # the greedy pass
            metrics[f"eval/{domain}/return"] = sum(t.episode_return for t in trajs) / n
            metrics[f"eval/{domain}/turns"] = sum(t.num_turns for t in trajs) / n
        return ok, sum(sum(t.loss_mask) for t in trajs)

    async def eval_event(self, split: str) -> ev.EvalResult:
        """:meth:`evaluate` as the ``EvalResult`` to publish."""
        metrics = await self.evaluate(split)
        return ev.EvalResult(run_id=self.s.run_id, step=self.strategy.step, policy_version=self.version, split=split,
                             metrics=metrics)

    # ----------------------------------------------------------------- warm-up

    def warm_up(self) -> list[float]:
        """``train.warmup_sft_steps`` supervised steps on the sources' worked solutions (prompt ->
        demonstration + eos); the loss of every step."""
        cfg = self.cfg
        if cfg.train.warmup_sft_steps <= 0:
            return []
        rng = random.Random(f"{cfg.run.seed}/warmup")
        t0 = time.perf_counter()
        tok = self.tokenizer
        weights = [d.ratio for d in cfg.data.domains]
        chat = self.eval_engine.chat  # prompts exactly as rollout renders them

        def batches() -> Iterator[list[SFTExample]]:
            total = cfg.train.warmup_sft_steps
            every = max(1, total // 10)
            for k in range(total):
                if k and k % every == 0:  # drawn lazily by the torch strategy: k steps are done
                    log.info("warm-up: %d/%d steps done (%.0f s)", k, total, time.perf_counter() - t0)
                out = []
                for _ in range(cfg.train.warmup_batch_size):
                    i = rng.choices(range(len(self.sources)), weights=weights)[0]
                    src, domain = self.sources[i], cfg.data.domains[i]
                    p = src.sample(rng)
                    system = domain.system_prompt or cfg.model.system_prompt
                    if envs.is_episodic(domain.source):
                        out += self._expert_examples(src, p, chat, system)
                        continue
                    demo = format_answer(src.demonstration(p, rng), domain.answer)
                    target = [*tok(demo, add_special_tokens=False)["input_ids"], tok.eos_token_id]
                    out.append(SFTExample(encode_prompt(tok, p.prompt, chat=chat, system_prompt=system), target))
                yield out

        return self.strategy.warmup(batches(), lr=cfg.train.warmup_lr, grad_clip=cfg.train.grad_clip)

    def _expert_examples(self, source: object, problem: envs.Problem, chat: bool, system: str) -> list[SFTExample]:
        """A multi-turn warm-up episode: the source's expert actions played in a local environment
        and rendered as the agent loop renders an episode: one example holding the whole episode
        (:func:`rollout.agent.expert_episode`), or with ``rollout.history_turns`` one example per
        turn, its window as the prompt (:func:`rollout.agent.expert_windows`)."""
        ref = episode_ref(problem.reference)
        env = envs.make_env(ref.env, prompt="", reference="", **ref.kwargs)
        actions = list(source.expert_actions(ref.seed))  # type: ignore[attr-defined]
        eot = self.tokenizer.eos_token_id
        if self.limits.history_turns is not None:
            return [SFTExample(prompt, target) for prompt, target in expert_windows(
                self.tokenizer, chat, env, ref.seed, actions, end_of_turn_id=eot, limits=self.limits,
                system_prompt=system)]
        prompt, target, mask = expert_episode(self.tokenizer, chat, env, ref.seed, actions, end_of_turn_id=eot,
                                              system_prompt=system, limits=self.limits)
        return [SFTExample(prompt, target, mask)]

    # ----------------------------------------------------------------- weights

    def _weights_dir(self, version: int) -> Path:
        return self.run_dir / "weights" / f"v{version:05d}"

    async def weights_event(self) -> ev.WeightsPublished:
        """Export the weights of ``version`` and describe them; versions older than the last
        :data:`KEEP_WEIGHT_VERSIONS` are removed from disk."""
        path, checksum = await asyncio.to_thread(self.strategy.export_weights, self._weights_dir(self.version))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        old = self._weights_dir(self.version - KEEP_WEIGHT_VERSIONS)
        if self.version >= KEEP_WEIGHT_VERSIONS and old.exists():
            shutil.rmtree(old, ignore_errors=True)
        return ev.WeightsPublished(run_id=self.s.run_id, policy_version=self.version, step=self.strategy.step,
                                   uri=str(path), checksum=checksum, num_bytes=size)

    # ----------------------------------------------------------------- checkpoints

    def _ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        """Where the checkpoint of the state *before* training step ``step`` lives."""
        return self._ckpt_root() / f"step_{step:06d}"

    def checkpoints(self) -> list[int]:
        """Steps that have a complete checkpoint, ascending."""
        root = self._ckpt_root()
        if not root.exists():
            return []
        return sorted(int(p.name[5:]) for p in root.glob("step_*")
                      if p.name[5:].isdigit() and (p / "stream_state.msgpack").exists())

    def save_checkpoint(self) -> Path:
        """Checkpoint the state before step ``strategy.step``: model, optimizer, critic, algorithm
        state, RNG, the undecided buffer, the decided and dead-lettered ids and the consumer
        positions. Older checkpoints beyond ``train.keep_checkpoints`` are removed (step 0, the
        RL start, is always kept)."""
        path = self.checkpoint_dir(self.strategy.step)
        self.strategy.save_checkpoint(path)
        buffer, decided, dead = self.buffer.snapshot()
        buffer += list(self.pool.values())  # undecided here too: a later resume re-runs their steps
        meta = StreamState(step=self.strategy.step, version=self.version,
                           positions={f"{tp.topic}:{tp.partition}": o for tp, o in self.positions.items()},
                           buffer=buffer, decided=decided, dead=dead)
        (path / "stream_state.msgpack").write_bytes(msgspec.msgpack.encode(meta))
        keep = self.cfg.train.keep_checkpoints
        if keep > 0:
            for old in [st for st in self.checkpoints() if st != 0][:-keep]:
                shutil.rmtree(self.checkpoint_dir(old), ignore_errors=True)
        return path

    def load_checkpoint(self, step: int | None = None) -> bool:
        """Restore the latest checkpoint (or the one of ``step``); False when there is none."""
        steps = self.checkpoints()
        if step is None and not steps:
            return False
        path = self.checkpoint_dir(steps[-1] if step is None else step)
        if not (path / "stream_state.msgpack").exists():
            raise FileNotFoundError(f"no checkpoint at {path}")
        self.setup_algorithm_models(fresh=False)
        self.strategy.load_checkpoint(path)
        meta = msgspec.msgpack.decode((path / "stream_state.msgpack").read_bytes(), type=StreamState)
        self.version = meta.version
        self.buffer.restore(meta.buffer, meta.decided, meta.dead)
        self.positions.clear()
        for key, off in meta.positions.items():
            topic, _, part = key.rpartition(":")
            self.positions[TopicPartition(topic, int(part))] = off
        return True

    def setup_algorithm_models(self, fresh: bool) -> None:
        """Load the reference model (only when a KL term is on) and create the critic (only for
        ``gae``). Fresh: the reference is the current policy (the RL start, after the warm-up),
        exported once to ``<run>/reference``; on resume it is read back from there."""
        algo = self.cfg.algorithm
        if algo.uses_reference:
            ref_dir = self.run_dir / "reference"
            if fresh:
                self.strategy.export_weights(ref_dir)
            self.strategy.init_reference(ref_dir)
        if fresh and algo.critic != "none":
            self.strategy.init_critic()
