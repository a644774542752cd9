"""Judges: an LLM-as-a-judge or a reward model scores a (prompt, response) pair in ``[0, 1]``.

Two kinds, one interface (``await judge.judge(prompt, response) -> Verdict``), both batching the
calls that arrive together:

* :class:`LLMJudge` renders the rubric, the prompt and the response as one user turn (through the
  chat template when the judge model has one), writes ``answer_prefix`` (``Score: ``) as the start
  of the judge's answer, and reads the score from what follows, per ``score``:
  ``number`` (greedy generation through the :class:`~rollout.engine.TorchEngine`; the first
  integer ``n`` must lie in ``[min_score, max_score]``; score ``(n - min) / (max - min)``),
  ``choice`` (greedy generation; the earliest label of ``choices``, whole word, any case, gives
  its value) or ``logprobs`` (no generation: one batched forward pass,
  :meth:`TorchEngine.next_token_logprobs`, gives the probabilities of the one-token labels
  ``min..max`` at the answer's first position; the score is their probability-weighted mean,
  normalised, as G-Eval's; labels holding less than ``min_label_mass``: no score).
* :class:`RewardModelJudge`: an ``AutoModelForSequenceClassification`` with one output reads the
  prompt and the response (as a user and an assistant turn of its chat template when it has one,
  else the two texts on separate lines); the output goes through ``normalize`` (``sigmoid``).

A judge never raises for a bad answer: a :class:`Verdict` with ``error`` set (score 0) says why,
and the judge service records it. A failing model (an exception in the forward pass) also
becomes an ``error`` verdict for every response of that batch. docs/rewards.md has the details.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from schemas.config import JudgeModelConfig
from schemas.errors import to_thread

DEFAULT_RUBRIC = ("You are grading an AI assistant's response to a user's request. Judge how well the "
                  "response does what the request asks: correct, complete, relevant and clearly written.")
"""The rubric of an ``llm`` judge whose ``rubric`` is empty."""

_INT_RE = re.compile(r"-?\d+")
_ANSWER_CHARS = 120  # of the judge's answer kept in a verdict


@dataclass(frozen=True)
class Verdict:
    """What a judge said about one response."""

    score: float
    """In ``[0, 1]`` for an ``llm`` judge and a ``sigmoid`` reward model; 0 when ``error``."""
    answer: str
    """The judge's answer (its text, or the label probabilities, or the reward model's output), short."""
    error: str = ""
    """Why there is no score (empty = scored)."""
    judge_s: float = 0.0
    """Seconds the judge call took (the batch's, for a batched call)."""


class Judge(Protocol):
    name: str

    async def judge(self, prompt: str, response: str) -> Verdict: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- rendering and parsing


def answer_format(cfg: JudgeModelConfig) -> str:
    """The last line of an ``llm`` judge's input: how to answer."""
    if (cfg.score or "number") == "choice":
        labels = " or ".join(repr(label) for label in cfg.choices)
        return f"Answer with one word: {labels}."
    return f"Answer with a single integer from {cfg.min_score} (worst) to {cfg.max_score} (best), and nothing else."


def judge_input(cfg: JudgeModelConfig, prompt: str, response: str) -> str:
    """What an ``llm`` judge reads (its user turn)."""
    rubric = cfg.rubric or DEFAULT_RUBRIC
    return f"{rubric}\n\n[Request]\n{prompt}\n\n[Response]\n{response}\n\n{answer_format(cfg)}"


def parse_number(text: str, lo: int, hi: int) -> tuple[float | None, str]:
    """``(normalised score, "")`` from the first integer of ``text`` in ``[lo, hi]``, else ``(None, why)``."""
    m = _INT_RE.search(text)
    if m is None:
        return None, f"no integer in the judge's answer {_short(text)!r}"
    n = int(m.group())
    if not lo <= n <= hi:
        return None, f"judge answered {n}, outside [{lo}, {hi}]"
    return (n - lo) / (hi - lo), ""


def parse_choice(text: str, choices: dict[str, float]) -> tuple[float | None, str]:
    """``(value, "")`` of the earliest label of ``choices`` in ``text`` (whole word, any case), else
    ``(None, why)``."""
    best: tuple[int, float] | None = None
    for label, value in choices.items():
        m = re.search(rf"(?<!\w){re.escape(label.strip())}(?!\w)", text, flags=re.IGNORECASE)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), value)
    if best is None:
        return None, f"none of {sorted(choices)} in the judge's answer {_short(text)!r}"
    return best[1], ""


def label_score(logprobs: list[float], lo: int, min_mass: float) -> tuple[float | None, float, str]:
    """From the logprobs of the labels ``lo, lo+1, ...`` (in order): ``(normalised expected label,
    mass, "")``, or ``(None, mass, why)`` when the labels hold less than ``min_mass``."""
    probs = [math.exp(lp) for lp in logprobs]
    mass = sum(probs)
    if mass <= 0 or mass < min_mass:
        return None, mass, f"the score labels hold {mass:.1%} of the judge's probability (< min_label_mass {min_mass:g})"
    hi = lo + len(probs) - 1
    expected = sum((lo + i) * p for i, p in enumerate(probs)) / mass
    return (expected - lo) / (hi - lo), mass, ""


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _ANSWER_CHARS else text[: _ANSWER_CHARS - 3] + "..."


def label_token_ids(tokenizer: Any, lo: int, hi: int) -> list[int]:
    """The token id of each label ``lo..hi``; ``ValueError`` when a label is not exactly one token."""
    ids: list[int] = []
    for n in range(lo, hi + 1):
        toks = tokenizer.encode(str(n), add_special_tokens=False)
        if len(toks) != 1:
            raise ValueError(f"score label {n} is {len(toks)} tokens for this tokenizer; score: logprobs needs "
                             "one token per label (use a smaller range, e.g. 1..5 or 0..9)")
        ids.append(int(toks[0]))
    return ids


# --------------------------------------------------------------------------- batching

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """Collects concurrent :meth:`submit` calls into batches of at most ``max_batch`` and runs
    ``fn(batch) -> results`` (blocking, in a worker thread) once per batch. A batch starts when
    ``max_batch`` items wait, or ``wait_s`` after its first item arrived. ``fn`` raising fails
    every item of that batch with its exception."""

    def __init__(self, fn: Callable[[list[T]], list[R]], max_batch: int, wait_s: float) -> None:
        self.fn, self.max_batch, self.wait_s = fn, max_batch, wait_s
        self._queue: list[tuple[T, asyncio.Future[tuple[R, float]]]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.batches = 0

    async def submit(self, item: T) -> tuple[R, float]:
        """``(result, seconds of the batch call)`` for ``item``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[R, float]] = loop.create_future()
        self._queue.append((item, fut))
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        assert self._wake is not None
        while self._queue:
            if len(self._queue) < self.max_batch and self.wait_s > 0:
                deadline = time.monotonic() + self.wait_s
                while len(self._queue) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), left)
                    except TimeoutError:
                        break
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
            live = [(item, fut) for item, fut in batch if not fut.done()]
            if not live:
                continue
            t0 = time.perf_counter()
            try:
                results = await to_thread(self.fn, [item for item, _ in live])
            except Exception as e:
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            self.batches += 1
            took = time.perf_counter() - t0
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result((result, took))


# --------------------------------------------------------------------------- judges


class LLMJudge:
    """An instruct LM as a judge (see the module doc)."""

    def __init__(self, name: str, cfg: JudgeModelConfig, *, device: str = "cpu", dtype: str = "float32",
                 max_batch: int = 16, batch_wait_s: float = 0.02, seed: int = 0) -> None:
        from rollout.engine import TorchEngine

        self.name, self.cfg = name, cfg
        self.mode = cfg.score or "number"
        self.engine = TorchEngine(cfg.path, max_batch=max_batch, device=device, dtype=dtype, seed=seed,
                                  chat_template=cfg.chat_template, system_prompt="")
        self.label_ids = label_token_ids(self.engine.tokenizer, cfg.min_score, cfg.max_score) \
            if self.mode == "logprobs" else []
        self._batcher: MicroBatcher[list[int], list[float]] = MicroBatcher(self._label_logprobs, max_batch, batch_wait_s)
        self.prefix_ids = list(self.engine.tokenizer.encode(cfg.answer_prefix, add_special_tokens=False)) \
            if cfg.answer_prefix else []
        self._room = self.engine.max_positions - (1 if self.mode == "logprobs" else cfg.max_new_tokens)

    def encode(self, prompt: str, response: str) -> list[int]:
        """The judge's input tokens; an over-long response is cut in the middle of the response
        text (kept: its start and end) so the rubric and the answer format always fit."""
        ids = self.engine.encode(judge_input(self.cfg, prompt, response)) + self.prefix_ids
        if len(ids) <= self._room:
            return ids
        tok = self.engine.tokenizer
        resp_ids = tok.encode(response, add_special_tokens=False)
        keep = max(0, len(resp_ids) - (len(ids) - self._room) - 8)
        head, tail = resp_ids[: keep // 2], resp_ids[len(resp_ids) - (keep - keep // 2):] if keep else []
        cut = f"{tok.decode(head)} [...] {tok.decode(tail)}"
        return (self.engine.encode(judge_input(self.cfg, prompt, cut)) + self.prefix_ids)[-self._room:]

    def _label_logprobs(self, batch: list[list[int]]) -> list[list[float]]:
        lp = self.engine.next_token_logprobs(batch)  # (b, V)
        return lp[:, self.label_ids].tolist()  # (b, labels)

    async def judge(self, prompt: str, response: str) -> Verdict:
        from rollout.engine import GenerationRequest
        from rollout.sampling import SamplingParams

        ids = self.encode(prompt, response)
        if self.mode == "logprobs":
            try:
                logprobs, took = await self._batcher.submit(ids)
            except Exception as e:
                return Verdict(0.0, "", f"judge model failed: {type(e).__name__}: {e}")
            score, mass, why = label_score(logprobs, self.cfg.min_score, self.cfg.min_label_mass)
            probs = " ".join(f"{self.cfg.min_score + i}:{math.exp(v):.2f}" for i, v in enumerate(logprobs))
            return Verdict(score or 0.0, f"p({probs}) mass {mass:.2f}", why, took)
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, greedy=True)
        t0 = time.perf_counter()
        completion = None
        async for c in self.engine.generate([GenerationRequest(f"judge-{id(ids)}", ids, params)]):
            completion = c
        took = time.perf_counter() - t0
        assert completion is not None
        if completion.error:
            return Verdict(0.0, "", f"judge model failed: {completion.error}", took)
        text = completion.text.strip()
        if self.mode == "choice":
            score, why = parse_choice(text, self.cfg.choices)
        else:
            score, why = parse_number(text, self.cfg.min_score, self.cfg.max_score)
        return Verdict(score or 0.0, _short(text), why, took)

    def close(self) -> None:
        pass


class RewardModelJudge:
    """A sequence-classification reward model (see the module doc)."""

    def __init__(self, name: str, cfg: JudgeModelConfig, *, device: str = "cpu", dtype: str = "float32",
                 max_batch: int = 16, batch_wait_s: float = 0.02) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from rollout.model_init import has_chat_template, load_tokenizer, use_chat_template

        self.name, self.cfg, self.device = name, cfg, torch.device(device)
        self.tokenizer = load_tokenizer(cfg.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            cfg.path, dtype=getattr(torch, dtype)).to(self.device).eval()
        if int(self.model.config.num_labels) != 1:
            raise ValueError(f"reward model {cfg.path} has {self.model.config.num_labels} outputs; a reward model "
                             "needs exactly one (num_labels=1)")
        self.base: Any = getattr(self.model, self.model.base_model_prefix, None)
        if self.base is None or not isinstance(getattr(self.model, "score", None), torch.nn.Module):
            raise ValueError(f"reward model {cfg.path} ({type(self.model).__name__}) has no decoder body with a "
                             "'score' head; decoder-only *ForSequenceClassification models are supported")
        self.chat = use_chat_template(self.tokenizer, cfg.chat_template) and has_chat_template(self.tokenizer)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._batcher: MicroBatcher[list[int], float] = MicroBatcher(self._score, max_batch, batch_wait_s)

    def encode(self, prompt: str, response: str) -> list[int]:
        """Prompt and response as the reward model reads them (the response's start is kept when
        too long: a reward model judges the beginning first)."""
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = list(self.tokenizer.encode(f"{prompt}\n{response}"))
        return ids[: self.max_len]

    def _score(self, batch: list[list[int]]) -> list[float]:
        import torch

        width = max(len(x) for x in batch)
        pad = self.model.config.pad_token_id
        pad = 0 if pad is None else int(pad)
        ids = torch.tensor([x + [pad] * (width - len(x)) for x in batch], device=self.device)  # (b, L)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch], device=self.device)  # (b, L)
        # the head reads the last real token: take it ourselves (transformers finds it from pad ids,
        # which breaks when the pad token also occurs inside the text)
        last = mask.sum(dim=1) - 1  # (b,)
        with torch.inference_mode():
            hidden = self.base(input_ids=ids, attention_mask=mask).last_hidden_state  # (b, L, H)
            logits = self.model.score(hidden[torch.arange(len(batch), device=last.device), last])  # (b, 1)
        return logits[:, 0].float().tolist()

    async def judge(self, prompt: str, response: str) -> Verdict:
        try:
            raw, took = await self._batcher.submit(self.encode(prompt, response))
        except Exception as e:
            return Verdict(0.0, "", f"reward model failed: {type(e).__name__}: {e}")
        if not math.isfinite(raw):
            return Verdict(0.0, f"{raw}", "reward model output is not finite", took)
        score = 1 / (1 + math.exp(-raw)) if self.cfg.normalize == "sigmoid" else raw
        return Verdict(score, f"{raw:.4f}", "", took)

    def close(self) -> None:
        pass


def load_judge(name: str, cfg: JudgeModelConfig, *, device: str = "cpu", dtype: str = "float32",
               max_batch: int = 16, batch_wait_s: float = 0.02) -> Judge:
    """The judge ``cfg`` describes, loaded onto ``device``."""
    if not (Path(cfg.path) / "config.json").is_file():
        raise ValueError(f"judge {name!r}: {cfg.path!r} is not a Hugging Face model directory (no config.json)")
    if cfg.kind == "reward_model":
        return RewardModelJudge(name, cfg, device=device, dtype=dtype, max_batch=max_batch, batch_wait_s=batch_wait_s)
    return LLMJudge(name, cfg, device=device, dtype=dtype, max_batch=max_batch, batch_wait_s=batch_wait_s)
