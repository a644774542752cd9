"""The trainer's supervised warm-up (``train.warmup_sft_steps``) on the task sources' demonstrations.

Each step draws ``train.warmup_batch_size`` problems (domains mixed by ``data.domains[].ratio``,
from ``Random(f"{seed}/warmup")``): a single-turn problem gives prompt -> worked solution in the
answer format its domain rewards + EOS; a multi-turn one gives the source's expert episode played in
a local environment and rendered as the agent loop renders an episode (a visual environment's
images with it; one example, or with ``rollout.history_turns`` one per turn, its window as the
prompt and its window's images with it). Prompts are rendered as rollout
renders them (a visual problem: its image tokens then the text, for a vision-language policy).
``Strategy.warmup`` trains on the batches with its own optimizer.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import envs
from envs.base import episode_ref
from rollout.agent import AgentLimits, expert_episode, expert_windows
from rollout.model_init import encode_prompt
from rollout.vlm import encode_vlm_prompt
from schemas.config import RunConfig
from trainer.sft import SFTExample
from trainer.strategy import Strategy, TorchStrategy

log = logging.getLogger("rollstream.trainer")

__all__ = ["format_answer", "warm_up"]


def format_answer(answer: str, mode: str) -> str:
    """A warm-up demonstration in the answer format its domain rewards: ``<answer>…</answer>`` for
    ``tag`` and ``auto``, ``\\boxed{…}`` for ``boxed``, as it is for ``raw``."""
    if mode in ("tag", "auto"):
        return f"<answer>{answer}</answer>"
    if mode == "boxed":
        return f"\\boxed{{{answer}}}"
    return answer


def warm_up(strategy: Strategy, cfg: RunConfig, sources: Sequence[Any], chat: bool, limits: AgentLimits) -> list[float]:
    """``train.warmup_sft_steps`` supervised steps on the sources' worked solutions (``sources``:
    one per ``data.domains`` entry; ``chat``: prompts go through the chat template); the loss of
    every step."""
    if cfg.train.warmup_sft_steps <= 0:
        return []
    rng = random.Random(f"{cfg.run.seed}/warmup")
    t0 = time.perf_counter()
    tok = strategy.tokenizer
    weights = [d.ratio for d in cfg.data.domains]

    def batches() -> Iterator[list[SFTExample]]:
        total = cfg.train.warmup_sft_steps
        every = max(1, total // 10)
        for k in range(total):
            if k and k % every == 0:  # drawn lazily by the torch strategy: k steps are done
                log.info("warm-up: %d/%d steps done (%.0f s)", k, total, time.perf_counter() - t0)
            out = []
            for _ in range(cfg.train.warmup_batch_size):
                i = rng.choices(range(len(sources)), weights=weights)[0]
                src, domain = sources[i], cfg.data.domains[i]
                p = src.sample(rng)
                system = domain.system_prompt or cfg.model.system_prompt
                if envs.is_episodic(domain.source):
                    out += expert_examples(tok, src, p, chat, system, limits, image_grid(strategy))
                    continue
                demo = format_answer(src.demonstration(p, rng), domain.answer)
                target = [*tok(demo, add_special_tokens=False)["input_ids"], tok.eos_token_id]
                if p.images:  # a visual problem: its image tokens, as the rollout engine renders them
                    out.append(SFTExample(image_prompt(strategy, p, p.system_prompt or system), target,
                                          images=p.images))
                    continue
                prompt = encode_prompt(tok, p.prompt, chat=chat, system_prompt=p.system_prompt or system)
                out.append(SFTExample(prompt, target))
            yield out

    return strategy.warmup(batches(), lr=cfg.train.warmup_lr, grad_clip=cfg.train.grad_clip)


def image_grid(strategy: Strategy) -> Any:
    """``images -> grid_thw`` of a vision-language policy's image processor (None: a text policy)."""
    if not isinstance(strategy, TorchStrategy) or strategy.images is None:
        return None
    source = strategy.images
    return lambda images: source.of_bytes(images)[1]


def image_prompt(strategy: Strategy, problem: envs.Problem, system: str) -> list[int]:
    """A visual problem's prompt ids for a vision-language policy: its images' tokens, then the text
    (:func:`rollout.vlm.encode_vlm_prompt`, as the rollout engine encodes it)."""
    if not isinstance(strategy, TorchStrategy) or strategy.images is None:
        raise ValueError(f"problem {problem.prompt_id} has images but the policy is not a vision-language model "
                         "trained by train.strategy torch")
    _, grid = strategy.images.of_bytes(problem.images)
    return encode_vlm_prompt(strategy.tokenizer, problem.prompt, grid, strategy.hf_model.config.image_token_id,
                             system_prompt=system)


def expert_examples(tokenizer: Any, source: Any, problem: envs.Problem, chat: bool, system: str,
                    limits: AgentLimits, image_grid: Any = None) -> list[SFTExample]:
    """A multi-turn warm-up episode: the source's expert actions played in a local environment and
    rendered as the agent loop renders an episode: one example holding the whole episode
    (:func:`rollout.agent.expert_episode`; a visual environment's images with it, ``image_grid``
    giving their ``grid_thw``), or with ``rollout.history_turns`` one example per turn, its window
    as the prompt and the images its window shows with it (:func:`rollout.agent.expert_windows`)."""
    ref = episode_ref(problem.reference)
    env = envs.make_env(ref.env, prompt="", reference="", **ref.kwargs)
    actions = list(source.expert_actions(ref.seed))
    eot = tokenizer.eos_token_id
    if limits.history_turns is not None:
        windows: list[tuple[bytes, ...]] = []
        turns = expert_windows(tokenizer, chat, env, ref.seed, actions, end_of_turn_id=eot, limits=limits,
                               system_prompt=system, image_grid=image_grid, images=windows)
        return [SFTExample(prompt, target, images=shown) for (prompt, target), shown in zip(turns, windows, strict=True)]
    shown: list[bytes] = []
    prompt, target, mask = expert_episode(tokenizer, chat, env, ref.seed, actions, end_of_turn_id=eot,
                                          system_prompt=system, limits=limits, image_grid=image_grid, images=shown)
    return [SFTExample(prompt, target, mask, images=tuple(shown))]
