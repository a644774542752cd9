"""The trainer service without Kafka: the impossible values it rejects, one pass of its batch
handler over scored samples and dead letters (in-memory context), its checkpoints, a resume that
re-runs recorded steps, a drain, and its start. Its groups: test_trainer_groups.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime.bus import Record
from schemas import events as ev
from schemas.sanity import check_generation, check_scored, check_task
from services.trainer.groups import group_complete


def scored(group: str, index: int, version: int = 0, size: int = 4, reward: float = 1.0) -> ev.ScoredSample:
    task = ev.RolloutTask(run_id="r", sample_id=f"{group}/{index}", group_id=group, index=index, group_size=size,
                          prompt_id="p", domain="arith", prompt="1+1=", reference="2")
    gen = ev.Generation(run_id="r", task=task, prompt_ids=[1], response_ids=[2], response_text="2", logprobs=[-0.1],
                        loss_mask=[1], finish_reason="stop", policy_version=version, policy_version_end=version)
    return ev.ScoredSample(run_id="r", generation=gen, reward=reward, policy_version=version)


def dead_letter(sample_id: str, group_id: str = "") -> ev.DeadLetter:
    return ev.DeadLetter(run_id="r", source_topic="rs.r.generations", partition=0, offset=0, key=None, value=None,
                         error="ValueError: bad", sample_id=sample_id, group_id=group_id)


# --------------------------------------------------------------------------- impossible values


def test_impossible_values_are_named() -> None:
    ok = scored("g", 0)
    assert check_scored(ok) is None
    nan = msgspec.structs.replace(ok, reward=float("nan"))
    assert "reward is nan" in str(check_scored(nan))
    gen = msgspec.structs.replace(ok.generation, logprobs=[-0.1, -0.2])
    assert "lengths differ" in str(check_generation(gen))
    assert "lengths differ" in str(check_scored(msgspec.structs.replace(ok, generation=gen)))
    task = msgspec.structs.replace(ok.generation.task, group_size=0)
    assert "impossible in a group of 0" in str(check_task(task))
    assert "unknown domain 'arith'" in str(check_task(ok.generation.task, domains={"math"}))
    assert check_task(ok.generation.task, domains={"arith"}) is None
    assert check_generation(msgspec.structs.replace(ok.generation, image_hashes=["ab" * 32])) is None
    odd = msgspec.structs.replace(ok.generation, image_hashes=["AB" * 32])
    assert "image hash 'ABAB" in str(check_generation(odd)) and "not a sha256 hex digest" in str(check_generation(odd))



def test_segment_starts_must_begin_untrained_prompts_in_order() -> None:
    gen = msgspec.structs.replace(scored("g", 0).generation, response_ids=[2, 5, 6, 2], logprobs=[-0.1, 0.0, 0.0, -0.2],
                                  loss_mask=[1, 0, 0, 1])
    assert check_generation(msgspec.structs.replace(gen, segment_starts=[1])) is None
    assert "must increase strictly" in str(check_generation(msgspec.structs.replace(gen, segment_starts=[2, 1])))
    assert "must increase strictly" in str(check_generation(msgspec.structs.replace(gen, segment_starts=[0])))
    assert "must increase strictly" in str(check_generation(msgspec.structs.replace(gen, segment_starts=[4])))
    assert "on a trained token" in str(check_generation(msgspec.structs.replace(gen, segment_starts=[3])))


# --------------------------------------------------------------------------- the handler


class FakeContext:
    """What the trainer's batch handler uses of a BatchContext, in memory."""

    def __init__(self, polled: list[Record]) -> None:
        self.polled = polled
        self.sent: list[tuple[str, ev.Event]] = []
        self.rejected: list[tuple[Record, str]] = []
        self.dead_letters: list[ev.DeadLetter] = []

    def emit(self, topic: str, event: ev.Event, key: Any = None, parent: Any = None) -> ev.Event:
        self.sent.append((topic, event))
        return event

    def reject(self, rec: Record, error: str) -> None:
        self.rejected.append((rec, error))

    async def flush(self) -> list[Any]:
        return []


def record(event: ev.Event, topic: str, offset: int) -> Record:
    return Record(f"rs.r.{topic}", 0, offset, None, b"", event, None, 0.0)


@pytest.fixture
def trainer(tmp_path: Path, model_dir: Path) -> Any:
    from schemas.config import parse_config
    from services.trainer import Trainer, TrainerSettings

    cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 8, micro_batch_size: 8, eval_every: 0, "
                       "checkpoint_every: 0, steps: 5}\ndata: {heldout_size: 2}")
    return Trainer(TrainerSettings(run_id="r", config=cfg, model_dir=str(model_dir), run_dir=str(tmp_path / "run")))


async def test_handler_trains_groups_completed_by_dead_letters(trainer: Any) -> None:
    events: list[tuple[ev.Event, str]] = [(scored("a", i, reward=float(i % 2)), "scored") for i in range(4)]
    events += [(scored("b", i, reward=float(i % 2)), "scored") for i in range(3)]
    events += [(dead_letter("b/3"), "dlq")]  # b completes without b/3
    events += [(scored("c", 0), "scored"), (dead_letter("c/1", "c"), "dlq"), (dead_letter("c/2"), "dlq"),
               (dead_letter("c/3"), "dlq")]  # c completes with one member: filtered
    events += [(scored("e", i, reward=float(i % 2)), "scored") for i in range(4)]
    bad = msgspec.structs.replace(scored("d", 0), reward=float("inf"))
    events += [(bad, "scored")]
    events += [(scored("f", i, reward=float(i % 2)), "scored") for i in range(3)]
    recs = [record(e, topic, i) for i, (e, topic) in enumerate(events)]
    ctx = FakeContext(recs)
    ctx.dead_letters.append(dead_letter("f/3", "f"))  # an undecodable f/3 the runtime dead-lettered in this poll
    await trainer.handle_batch(recs, ctx)

    assert [error for _, error in ctx.rejected] == ["scored d/0: reward is inf (not finite)"]
    outcomes = {e.sample_id: e for t, e in ctx.sent if isinstance(e, ev.SampleOutcome)}
    trained = {sid for sid, o in outcomes.items() if o.status == "trained"}
    assert trained == {"a/0", "a/1", "a/2", "a/3", "b/0", "b/1", "b/2", "e/0", "e/1", "e/2", "e/3"}
    assert outcomes["c/0"].status == "filtered" and "group too small" in outcomes["c/0"].reason
    # dead-lettered samples get no outcome from the trainer: their dead letter is their record
    assert not {"b/3", "c/1", "c/2", "c/3", "d/0", "f/3"} & set(outcomes)
    steps = [e for _, e in ctx.sent if isinstance(e, ev.TrainStep)]
    assert len(steps) == 1 and len(steps[0].sample_ids) == 11  # a, b (3 left) and e fill the batch of 8
    assert [e.policy_version for _, e in ctx.sent if isinstance(e, ev.WeightsPublished)] == [1]
    last_dlq = max(r.offset for r in recs if r.topic == "rs.r.dlq")
    assert trainer.state.positions == {"rs.r.scored:0": len(recs), "rs.r.dlq:0": last_dlq + 1}

    # the real b/3 (and d/0) arriving later change nothing
    late = [record(scored("b", 3), "scored", 100), record(scored("d", 0), "scored", 101)]
    ctx2 = FakeContext(late)
    await trainer.handle_batch(late, ctx2)
    assert ctx2.sent == [] and ctx2.rejected == []
    assert list(trainer.state.groups) == ["f"] and trainer.groups.complete("f")  # f waits for a batch to fill


async def test_redundant_groups_keep_the_first_finishers_and_cancel_the_rest(trainer: Any) -> None:
    """rollout.group_size_redundancy: a group of 4 + 2 completes with its first 4 arrivals; the surplus
    one already here and the 2 not arrived are filtered as cancelled; a late arrival is ignored."""
    def red(group: str, index: int, reward: float) -> ev.ScoredSample:
        s = scored(group, index, reward=reward)
        task = msgspec.structs.replace(s.generation.task, redundancy=2)
        return msgspec.structs.replace(s, generation=msgspec.structs.replace(s.generation, task=task))

    order = [("a", 5), ("a", 0), ("a", 3), ("b", 1), ("a", 1), ("a", 4), ("b", 0), ("b", 2), ("b", 5), ("b", 4)]
    recs = [record(red(g, i, float(i % 2)), "scored", k) for k, (g, i) in enumerate(order)]
    assert not group_complete([red("a", i, 0.0) for i in (5, 0, 3)], set())
    assert group_complete([red("a", i, 0.0) for i in (0, 1)], {"a/2", "a/3", "a/4", "a/5"})
    ctx = FakeContext(recs)
    await trainer.handle_batch(recs, ctx)
    outcomes = {e.sample_id: e for _, e in ctx.sent if isinstance(e, ev.SampleOutcome)}
    trained = {sid for sid, o in outcomes.items() if o.status == "trained"}
    assert trained == {"a/5", "a/0", "a/3", "a/1", "b/1", "b/0", "b/2", "b/5"}
    cancelled = {sid for sid, o in outcomes.items() if o.reason.startswith("cancelled:")}
    assert cancelled == {"a/2", "a/4", "b/3", "b/4"}
    assert all(outcomes[sid].status == "filtered" for sid in cancelled)
    late = [record(red("a", 2, 1.0), "scored", 50)]
    ctx2 = FakeContext(late)
    await trainer.handle_batch(late, ctx2)
    assert ctx2.sent == [] and not trainer.state.groups


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_restores_model_buffer_dead_letters_and_positions(tmp_path: Path, model_dir: Path) -> None:
    import torch

    from schemas.config import parse_config
    from services.trainer import Trainer, TrainerSettings

    cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 4}\ndata: {heldout_size: 2}")
    settings = TrainerSettings(run_id="r", config=cfg, model_dir=str(model_dir), run_dir=str(tmp_path / "run"))
    a = Trainer(settings)
    a.groups.add(scored("g", 0))
    a.groups.dead_letter("g/3")
    a.state.decided.add("old/0")
    a.state.positions["rs.r.scored:2"] = 17
    a.state.version = 3
    with torch.no_grad():
        next(a.strategy.model.parameters()).add_(1.0)
    a.save_checkpoint()

    b = Trainer(settings)
    assert b.load_checkpoint()
    assert b.state == a.state and b.groups.state is b.state  # the state, whole
    assert b.state.version == 3 and b.state.decided == {"old/0", "g/3"} and b.state.dead == {"g": {"g/3"}}
    assert [s.generation.task.sample_id for s in b.state.groups["g"]] == ["g/0"]
    assert b.state.positions == {"rs.r.scored:2": 17}
    for pa, pb in zip(a.strategy.model.parameters(), b.strategy.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # a redelivered sample of a decided or buffered id is ignored
    assert not b.groups.add(scored("g", 0)) and not b.groups.add(scored("old", 0))
    assert len(b.state.groups["g"]) == 1 and "old" not in b.state.groups


def test_reference_model_loaded_only_when_a_kl_term_is_on(tmp_path: Path, model_dir: Path) -> None:
    from schemas.config import parse_config
    from services.trainer import Trainer, TrainerSettings

    for text, wants_ref in [("", False), ("algorithm: {use_kl_loss: true}", True),
                            ("algorithm: {add_token_level_kl: true}", True)]:
        cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 4}\ndata: {heldout_size: 2}\n" + text)
        run_dir = tmp_path / f"run{int(wants_ref)}{len(text)}"
        t = Trainer(TrainerSettings(run_id="r", config=cfg, model_dir=str(model_dir), run_dir=str(run_dir)))
        t.setup_algorithm_models(fresh=True)
        assert (t.strategy.ref_model is not None) == wants_ref, text
        assert (run_dir / "reference").exists() == wants_ref
        t.save_checkpoint()
        again = Trainer(TrainerSettings(run_id="r", config=cfg, model_dir=str(model_dir), run_dir=str(run_dir)))
        assert again.load_checkpoint()
        assert (again.strategy.ref_model is not None) == wants_ref


# --------------------------------------------------------------------------- resume and drain


def groups_of(names: str, first_offset: int = 0, version: int = 0) -> list[Record]:
    samples = [scored(g, i, version=version, reward=float(i % 2)) for g in names for i in range(4)]
    return [record(s, "scored", first_offset + i) for i, s in enumerate(samples)]


def sent_of(ctx: FakeContext, kind: type) -> list[Any]:
    return [e for _, e in ctx.sent if isinstance(e, kind)]


async def test_a_resumed_trainer_reruns_recorded_steps_and_publishes_them_once(tmp_path: Path, model_dir: Path) -> None:
    """Trained steps 0 and 1 after the checkpoint of step 0, then died: the next trainer restores
    that checkpoint, re-runs steps 0 and 1 from their recorded batches (to the same model),
    publishes no second TrainStep or outcome for them, and goes on with step 2."""
    import torch

    from schemas.config import parse_config
    from services.trainer import Trainer, TrainerSettings
    from services.trainer.history import History

    cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 8, micro_batch_size: 8, eval_every: 0, "
                       "checkpoint_every: 0, steps: 5}\ndata: {heldout_size: 2}")
    settings = TrainerSettings(run_id="r", config=cfg, model_dir=str(model_dir), run_dir=str(tmp_path / "run"))
    first = Trainer(settings)
    first.save_checkpoint()  # the RL start
    recs = groups_of("abcd") + groups_of("ef", 16, version=2)
    ctx = FakeContext(recs[:16])
    await first.handle_batch(recs[:16], ctx)
    recorded = sent_of(ctx, ev.TrainStep)
    assert [s.step for s in recorded] == [0, 1]
    history = History()
    for _, e in ctx.sent:
        history.observe(e)

    again = Trainer(settings)
    assert again.load_checkpoint() and again.strategy.step == 0
    again.resume_from(history)
    assert again.replay.steps == {0: recorded[0].sample_ids, 1: recorded[1].sample_ids}
    ctx2 = FakeContext(recs[:16])  # read again from the checkpoint's positions
    await again.handle_batch(recs[:16], ctx2)
    assert again.replay.done == 2 and again.strategy.step == again.state.step == 2 and again.state.version == 2
    assert ctx2.sent == []  # steps, outcomes and the newest weights are all on the record already
    for pa, pb in zip(first.strategy.model.parameters(), again.strategy.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    ctx3 = FakeContext(recs[16:])
    await again.handle_batch(recs[16:], ctx3)  # new groups: a new step
    assert [s.step for s in sent_of(ctx3, ev.TrainStep)] == [2]
    assert {o.sample_id for o in sent_of(ctx3, ev.SampleOutcome)} == {f"{g}/{i}" for g in "ef" for i in range(4)}
    assert [w.policy_version for w in sent_of(ctx3, ev.WeightsPublished)] == [3]


async def test_a_checkpoint_taken_while_re_running_keeps_the_samples_of_later_recorded_steps(
        tmp_path: Path, model_dir: Path) -> None:
    """A resumed trainer checkpoints after each re-run step; the samples it already read for later
    recorded steps (the state's pool) are in that checkpoint, so a trainer resuming from it re-runs
    those steps without reading them again."""
    import shutil

    import torch

    from schemas.config import parse_config
    from services.trainer import Trainer, TrainerSettings
    from services.trainer.history import History

    cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 8, micro_batch_size: 8, eval_every: 0, "
                       "checkpoint_every: 1, steps: 5}\ndata: {heldout_size: 2}")
    settings = TrainerSettings(run_id="r", config=cfg, model_dir=str(model_dir), run_dir=str(tmp_path / "run"))
    first = Trainer(settings)
    first.save_checkpoint()
    recs = {g: groups_of(g, 4 * k, version=k // 2) for k, g in enumerate("abcdef")}
    ctx = FakeContext([])
    for g in "abcdef":
        await first.handle_batch(recs[g], ctx)
    assert [s.step for s in sent_of(ctx, ev.TrainStep)] == [0, 1, 2]
    history = History()
    for _, e in ctx.sent:
        history.observe(e)
    for step in first.checkpoints.steps()[1:]:
        shutil.rmtree(first.checkpoints.dir(step))  # the record is ahead of the checkpoint of step 0

    again = Trainer(settings)
    assert again.load_checkpoint()
    again.resume_from(history)
    quiet = FakeContext([])
    for g in "cefab":  # step 0 is re-run (and checkpointed) once a and b are here; d, of step 1, is not
        await again.handle_batch(recs[g], quiet)
    assert again.state.step == 1 and again.checkpoints.steps() == [0, 1]
    assert set(again.state.pool) == {f"{g}/{i}" for g in "cef" for i in range(4)}

    third = Trainer(settings)
    assert third.load_checkpoint() and third.state.step == 1
    assert set(third.state.pool) == set(again.state.pool) and not third.state.groups
    third.resume_from(history)
    assert sorted(third.replay.steps) == [1, 2]
    await third.handle_batch(recs["d"], quiet)
    assert third.state.step == 3 and third.replay.done == 2 and not third.state.pool and quiet.sent == []
    for pa, pb in zip(first.strategy.model.parameters(), third.strategy.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


async def test_a_user_drain_ends_training_after_the_step_under_way(trainer: Any) -> None:
    recs = groups_of("ab")
    await trainer.handle_batch(recs, FakeContext(recs))
    assert trainer.strategy.step == 1
    drain = record(ev.Drain(run_id="r", reason="stopped by user", origin="user"), "control", 0)
    more = [drain, *groups_of("cd", 100)]
    ctx = FakeContext(more)
    await trainer.handle_batch(more, ctx)
    assert sent_of(ctx, ev.TrainStep) == []  # no new step after the drain
    [own] = sent_of(ctx, ev.Drain)
    assert own.reason == "trainer stopped after 1 of 5 steps: stopped by user" and own.origin == "trainer"
    assert [(e.split, e.step) for e in sent_of(ctx, ev.EvalResult)] == [("heldout", 1)]  # the final eval
    assert trainer.checkpoints.steps()[-1] == 1 and trainer.drained
    # the final model: the policy where it stopped, a Hugging Face directory transformers loads
    from transformers import AutoModelForCausalLM

    from weights import weights_match

    final = Path(trainer.s.run_dir) / "final"
    assert weights_match(final, trainer.strategy.model.state_dict())
    assert weights_match(final, AutoModelForCausalLM.from_pretrained(final).state_dict())
    assert any(final.glob("tokenizer*.json"))
    closed = sent_of(ctx, ev.SampleOutcome)
    assert len(closed) == 8 and all(o.status == "filtered" and "run finished" in o.reason for o in closed)
    # its own drain coming back, and late samples: closed, nothing else
    late = [record(own, "control", 1), *groups_of("e", 200)]
    ctx2 = FakeContext(late)
    await trainer.handle_batch(late, ctx2)
    assert [type(e).__name__ for _, e in ctx2.sent] == ["SampleOutcome"] * 4


# --------------------------------------------------------------------------- start


class FakeRunner:
    def __init__(self) -> None:
        self.sent: list[tuple[str, ev.Event]] = []

    async def send(self, topic: str, *events: ev.Event, key: Any = None) -> list[Any]:
        self.sent += [(topic, e) for e in events]
        return []


@pytest.mark.parametrize("warmup", [0, 3])
async def test_start_evaluates_the_same_weights_once(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                     warmup: int) -> None:
    """Without a warm-up, ``init`` and ``heldout`` at step 0 are one evaluation published after
    the weights (rollout need not wait for it); with one, ``init`` comes first, before the weights."""
    import services.trainer.service as ts
    from schemas.config import parse_config
    from services.trainer.history import History

    async def no_history(*_: Any) -> History:
        return History()

    monkeypatch.setattr(ts, "read_history", no_history)
    cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 8, micro_batch_size: 8, eval_every: 0, "
                       f"checkpoint_every: 0, steps: 5, warmup_sft_steps: {warmup}, warmup_batch_size: 4}}\n"
                       "data: {heldout_size: 2}")
    trainer = ts.Trainer(ts.TrainerSettings(run_id="r", config=cfg, model_dir=str(model_dir), run_dir=str(tmp_path)))
    evaluated: list[str] = []
    real = trainer.eval_event

    async def counted(split: str) -> ev.EvalResult:
        evaluated.append(split)
        return await real(split)

    monkeypatch.setattr(trainer, "eval_event", counted)
    runner = FakeRunner()
    await trainer.on_start(runner)  # type: ignore[arg-type]
    order = [(t, getattr(e, "split", "")) for t, e in runner.sent]
    evals = [e for _, e in runner.sent if isinstance(e, ev.EvalResult)]
    if warmup:
        assert evaluated == ["init", "heldout"]
        assert order == [("metrics", "init"), ("weights", ""), ("metrics", "heldout")]
    else:
        assert evaluated == ["init"]
        assert order == [("weights", ""), ("metrics", "init"), ("metrics", "heldout")]
        assert evals[0].metrics == evals[1].metrics and evals[0].event_id != evals[1].event_id
        assert evals[0].answers == evals[1].answers  # the same answers, recorded with both
    assert all(len(e.answers) == 2 for e in evals)  # the greedy answers to both held-out problems
    assert all(e.step == 0 and e.policy_version == 0 for e in evals)
