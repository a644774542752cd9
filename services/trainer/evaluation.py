"""The trainer's evaluation, wired: rollout's engine and the run's task sources into :mod:`trainer.evaluate`.

:class:`Evaluation` holds a local torch engine (whatever ``rollout.engine`` is), the task source of
every domain with its held-out problems and verifier, and the agent's limits. :meth:`Evaluation.run`
loads the weights of a version (when exported; before the warm-up the initial model is evaluated)
and evaluates them greedily, and with ``train.eval_samples`` k > 0 also k sampled answers per
problem at the rollout's temperature and top-p; both stop where rollout stops (``rollout.stop``).
Single-turn answers are scored as the reward router scores them (bounded by ``reward.timeout_s``,
off the event loop: a verifier that hangs or crashes scores 0); multi-turn problems are played as
greedy or sampled episodes against in-process environments (no environment workers needed; a
visual environment's images go through the run's blob store as in rollout).
Given an ``answers`` list, it gets the greedy answers to the first :data:`ANSWERS_RECORDED` held-out
problems of each single-turn domain as :class:`schemas.events.EvalAnswer` (for ``EvalResult.answers``);
a visual problem's images are written to the run's blob store (once: the held-out set is fixed) and
the answer names their digests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import envs
from blobs import BlobStore
from envs.base import episode_ref
from rollout.agent import AgentLimits, LocalEnvClient, Trajectory, run_episode
from rollout.engine import Completion, Engine, GenerationRequest, TorchEngine
from rollout.factory import make_engine
from rollout.sampling import SamplingParams
from rollout.vlm import ImageInputs
from schemas import events as ev
from schemas.config import DomainConfig, RunConfig
from schemas.errors import to_thread
from trainer.evaluate import Answered, Domain, Problem, evaluate

__all__ = ["ANSWERS_RECORDED", "Evaluation"]

ANSWERS_RECORDED = 8
"""Greedy answers an evaluation records per single-turn domain (its first held-out problems)."""


class EngineCalls:
    """A rollout :class:`~rollout.engine.Engine` as :class:`trainer.evaluate.Engine` (a problem with
    images needs a vision-language :class:`~rollout.engine.TorchEngine`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._images: dict[tuple[bytes, ...], ImageInputs] = {}

    def _inputs(self, images: Sequence[bytes]) -> ImageInputs | None:
        if not images:
            return None
        if not isinstance(self.engine, TorchEngine):
            raise ValueError("a held-out problem has images: the evaluation engine must be a torch VLM engine")
        key = tuple(images)
        if key not in self._images:
            self._images[key] = self.engine.image_inputs(list(images))
        return self._images[key]

    def encode(self, prompt: str, system_prompt: str | None = None, images: Sequence[bytes] = ()) -> list[int]:
        inputs = self._inputs(images)
        if inputs is not None:
            assert isinstance(self.engine, TorchEngine)
            return self.engine.encode(prompt, system_prompt, inputs)
        return self.engine.encode(prompt, system_prompt)

    def generate(self, prompts: list[tuple[str, list[int], Sequence[bytes]]], params: SamplingParams
                 ) -> AsyncIterator[Completion]:
        return self.engine.generate([GenerationRequest(rid, ids, params, images=self._inputs(images))
                                     for rid, ids, images in prompts])


class Evaluation:
    """The evaluation engine and the held-out problems of a run (see the module doc)."""

    def __init__(self, cfg: RunConfig, model_dir: str, *, device: str, max_batch: int,
                 blob_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.blobs = BlobStore(blob_dir) if blob_dir else None
        """The run's blob store: a recorded visual answer's images go there."""
        self.engine = make_engine(cfg, model_dir, max_batch=max_batch, device=device, seed=cfg.run.seed,
                                  policy_version=0, local=True)
        self.sources = [envs.make_source(d.source, **d.kwargs) for d in cfg.data.domains]
        """The task source of every domain of ``data.domains`` (the warm-up draws from them too)."""
        ro = cfg.rollout
        self.limits = AgentLimits(max_turns=ro.max_turns, max_tokens_per_turn=ro.max_new_tokens,
                                  max_context_tokens=min(ro.max_context_tokens, self.engine.max_positions),
                                  history_turns=ro.history_turns)
        self.domains = [self._domain(d, src) for d, src in zip(cfg.data.domains, self.sources, strict=True)]

    async def _episode_images(self, hashes: list[str]) -> ImageInputs:
        """An episode's observation images, from the blob store through the engine's processor."""
        store, engine = self.blobs, self.engine
        if store is None or not isinstance(engine, TorchEngine) or not engine.vlm:
            raise ValueError("the evaluation has no blob store or no vision-language engine")
        return await to_thread(lambda: engine.image_inputs([store.get(h) for h in hashes], hashes))

    def _domain(self, d: DomainConfig, source: Any) -> Domain[SamplingParams]:
        system = d.system_prompt or self.cfg.model.system_prompt
        problems = source.heldout(self.cfg.data.heldout_size)
        if envs.is_episodic(d.source):
            async def play(p: Problem, episode_id: str, params: SamplingParams) -> Trajectory:
                ref = episode_ref(p.reference)
                return await run_episode(self.engine, self.engine.tokenizer, LocalEnvClient(envs.make_env, self.blobs),
                                         episode_id=episode_id, env=ref.env, env_kwargs=ref.kwargs, seed=ref.seed,
                                         params=params, limits=self.limits, system_prompt=system,
                                         images=self._episode_images)

            return Domain(d.name, problems, system, play=play)
        verifier, reward = d.verifier or source.default_verifier, self.cfg.reward

        async def score(text: str, reference: str) -> bool:
            res = await to_thread(envs.score_response, verifier, text, reference, d.verifier_kwargs,
                                          answer=d.answer, format_reward=d.format_reward, timeout_s=reward.timeout_s,
                                          isolation=reward.isolation)
            return bool(res.correct)

        return Domain(d.name, problems, system, score=score)

    async def run(self, weights: Path, version: int, answers: list[ev.EvalAnswer] | None = None) -> dict[str, float]:
        """Every metric of an evaluation of ``version`` (its weights at ``weights`` when they exist);
        ``answers`` gets the recorded greedy answers (see the module doc)."""
        if weights.exists():
            await self.engine.load_weights(weights, version)
        ro, k = self.cfg.rollout, self.cfg.train.eval_samples
        greedy = SamplingParams(max_new_tokens=ro.max_new_tokens, greedy=True, stop=tuple(ro.stop))
        sampled = None
        if k > 0:
            sampled = (SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
                                      stop=tuple(ro.stop)), k)
        answered: list[Answered] = []
        metrics = await evaluate(EngineCalls(self.engine), self.domains, greedy, sampled, answered)
        if answers is not None:
            answers += await to_thread(self._recorded, answered)
        return metrics

    def _recorded(self, answered: list[Answered]) -> list[ev.EvalAnswer]:
        """The first :data:`ANSWERS_RECORDED` answers of each domain, their images in the blob store."""
        cut, kept = ev.EVAL_TEXT_MAX_CHARS, dict[str, int]()
        out = []
        for a in answered:
            kept[a.domain] = kept.get(a.domain, 0) + 1
            if kept[a.domain] > ANSWERS_RECORDED:
                continue
            hashes = []
            if a.problem.images:
                if self.blobs is None:
                    raise RuntimeError("evaluation: a held-out problem has images but there is no blob store (blob_dir)")
                hashes = [self.blobs.put(b) for b in a.problem.images]
            out.append(ev.EvalAnswer(domain=a.domain, prompt_id=a.problem.prompt_id, prompt=a.problem.prompt[:cut],
                                     reference=a.problem.reference, response=a.text[:cut], correct=a.correct,
                                     image_hashes=hashes))
        return out
