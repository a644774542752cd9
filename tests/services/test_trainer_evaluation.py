"""The trainer's evaluation as wired to rollout's engine and the run's task sources: the greedy
accuracy, and with ``train.eval_samples`` the mean accuracy of sampled answers (single-turn domains,
at the rollout's temperature, top-p and stop strings) or sampled episodes (multi-turn domains, in
in-process environments). The metrics themselves: tests/trainer/test_evaluate.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import envs
from blobs import BlobStore
from rollout.engine import Completion, GenerationRequest
from schemas import events as ev
from schemas.config import parse_config
from services.trainer.evaluation import ANSWERS_RECORDED, Evaluation


def evaluation(model_dir: Path, yaml: str) -> Evaluation:
    return Evaluation(parse_config(yaml), str(model_dir), device="cpu", max_batch=64)


async def test_sampled_accuracy_is_the_mean_over_k_answers_per_problem(tmp_path: Path, model_dir: Path) -> None:
    c = evaluation(model_dir, "data: {heldout_size: 6}\ntrain: {eval_samples: 3}\n"
                              "rollout: {temperature: 0.7, top_p: 0.9, stop: ['=']}")
    (domain,) = c.domains
    problems = domain.problems
    reference = {p.prompt_id: p.reference for p in problems}
    seen: list[GenerationRequest] = []

    async def generate(reqs: list[GenerationRequest]) -> AsyncIterator[Completion]:
        # the greedy answer is right, and of the k samples only the first (#0)
        for r in reqs:
            seen.append(r)
            pid, _, j = r.request_id.partition("#")
            text = reference[pid] if r.params.greedy or j == "0" else "no"
            yield Completion(r.request_id, r.prompt_ids, [1], [0.0], text, "stop", 0, 0)

    c.engine.generate = generate  # type: ignore[method-assign]
    metrics = await c.run(tmp_path / "no-weights-yet", 0)
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/arith/accuracy"] == 1.0
    assert metrics["eval/accuracy_sampled"] == pytest.approx(1 / 3)
    assert metrics["eval/arith/accuracy_sampled"] == pytest.approx(1 / 3)
    greedy = [r for r in seen if r.params.greedy]
    sampled = [r for r in seen if not r.params.greedy]
    assert len(greedy) == 6 and len(sampled) == 18
    assert {r.request_id for r in sampled} == {f"{p}#{j}" for p in reference for j in range(3)}
    assert all(r.params.temperature == 0.7 and r.params.top_p == 0.9 and r.params.stop == ("=",) for r in sampled)
    assert all(r.params.stop == ("=",) for r in greedy)  # evaluation stops where rollout stops


async def test_without_eval_samples_only_the_greedy_pass_runs(tmp_path: Path, model_dir: Path) -> None:
    c = evaluation(model_dir, "data: {heldout_size: 4}")
    metrics = await c.run(tmp_path / "no-weights-yet", 0)
    assert set(metrics) == {"eval/accuracy", "eval/arith/accuracy", "eval/response_len"}


async def test_sampled_episodes_play_each_held_out_room_k_times(tmp_path: Path, model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    c = evaluation(model_dir, "data: {heldout_size: 4, domains: [{name: lake, source: frozenlake}]}\n"
                              "train: {eval_samples: 2}\nrollout: {max_turns: 3, max_new_tokens: 8}")
    made: list[dict[str, Any]] = []
    make_env = envs.make_env

    def counting(name: str, **kwargs: Any) -> Any:
        made.append(kwargs)
        return make_env(name, **kwargs)

    monkeypatch.setattr(envs, "make_env", counting)
    metrics = await c.run(tmp_path / "no-weights-yet", 0)
    assert len(made) == 4 + 2 * 4  # one greedy episode and two sampled ones per held-out room
    assert 0 <= metrics["eval/lake/accuracy_sampled"] <= 1 and metrics["eval/accuracy_sampled"] == \
        metrics["eval/lake/accuracy_sampled"]
    assert {"eval/lake/return", "eval/lake/turns"} <= set(metrics)


async def test_the_first_held_out_answers_are_recorded(tmp_path: Path, model_dir: Path) -> None:
    c = evaluation(model_dir, "data: {heldout_size: 10}")
    answers: list[ev.EvalAnswer] = []
    metrics = await c.run(tmp_path / "no-weights-yet", 0, answers)
    problems = c.domains[0].problems
    assert [a.prompt_id for a in answers] == [p.prompt_id for p in problems[:ANSWERS_RECORDED]]
    assert [(a.domain, a.prompt, a.reference) for a in answers[:1]] == [("arith", problems[0].prompt,
                                                                         problems[0].reference)]
    assert all(a.image_hashes == [] for a in answers)  # a text task
    assert sum(a.correct for a in answers) <= round(metrics["eval/accuracy"] * 10)


async def test_a_visual_answer_names_its_image_in_the_blob_store(tmp_path: Path, vlm_dir: Path) -> None:
    cfg = parse_config("data: {heldout_size: 2, domains: [{name: see, source: shapes}]}\nrollout: {max_new_tokens: 4}")
    c = Evaluation(cfg, str(vlm_dir), device="cpu", max_batch=8, blob_dir=tmp_path / "blobs")
    answers: list[ev.EvalAnswer] = []
    await c.run(tmp_path / "no-weights-yet", 0, answers)
    problems = c.domains[0].problems
    assert len(answers) == 2 and all(len(a.image_hashes) == 1 for a in answers)
    store = BlobStore(tmp_path / "blobs")
    assert [store.get(a.image_hashes[0]) for a in answers] == [p.images[0] for p in problems]
    assert {a.reference for a in answers} <= {"red", "green", "blue", "yellow", "black"}
