"""A small but complete run as real events, published through the broker (for the recorder,
analytics-docs and store-server tests).

Two trainer steps over two single-turn domains (groups of two), one multi-turn episode with
environment events, a stale sample, a filtered one, a dead-lettered one, one still in flight, a
decode failure, an undecodable message, weights, evals and the run's start and finish. Times
are realistic and increasing (seconds apart, ending now).
"""

from __future__ import annotations

import time

from runtime.bus import Producer, TopicAdmin
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, topic_name


def topic_of(event: ev.Event) -> str:
    """The logical topic an event goes to (from the topic registry)."""
    for name, spec in TOPICS.items():
        if type(event) in getattr(spec.event_type, "__args__", (spec.event_type,)):
            return name
    raise AssertionError(type(event))


def run_events(run_id: str) -> list[ev.Event]:
    """The run's events in publishing order (``RunFinished`` last)."""
    t = time.time() - 200.0
    out: list[ev.Event] = [ev.RunStarted(run_id=run_id, ts=t, config_json="{}", host="test"),
                           ev.WeightsPublished(run_id=run_id, ts=t, policy_version=0, step=0, uri="/w/v0")]

    def life(sid: str, group: str, domain: str, version: int, reward: float, t0: float, *, status: ev.SampleStatus = "trained",
             step: int = -1, reason: str = "", trained_version: int = -1, turns: int = 1, env_s: float = 0.0,
             until: str = "decided", episode_id: str = "", env_finish: str = "") -> None:
        task = ev.RolloutTask(run_id=run_id, ts=t0, sample_id=sid, group_id=group, index=int(sid[-1]), group_size=2,
                              prompt_id=f"{domain}-{group}", domain=domain, prompt="12+7=", reference="19",
                              policy_version=version)
        out.append(task)
        if until == "issued":
            return
        gen = ev.Generation(run_id=run_id, ts=t0 + 1.5 + env_s, task=task, prompt_ids=[1, 2, 3],
                            response_ids=[4] * (3 + len(out) % 5), response_text="19", logprobs=[-0.1] * (3 + len(out) % 5),
                            loss_mask=[1] * (3 + len(out) % 5), finish_reason="stop", policy_version=version,
                            policy_version_end=version, worker_id="w0", queued_s=0.25, gen_s=1.25, env_s=env_s,
                            num_turns=turns, episode_id=episode_id, env_finish=env_finish,
                            success=bool(episode_id) and reward > 0)
        scored = ev.ScoredSample(run_id=run_id, ts=t0 + 2.0 + env_s, generation=gen, reward=reward,
                                 rewards={"correct": reward}, verifier="exact", details="19 == 19", reward_s=0.05,
                                 policy_version=version)
        out.extend([gen, scored])
        if until == "scored":
            return
        out.append(ev.SampleOutcome(run_id=run_id, ts=t0 + 3.0 + env_s, sample_id=sid, group_id=group,
                                    status=status, reason=reason, policy_version=version,
                                    trained_version=trained_version, step=step))

    for step in range(2):
        t_step = t + 10.0 + 40.0 * step
        ids = []
        for d, domain in enumerate(("arith", "math")):
            group = f"s{step}{domain}"
            for i in range(2):
                sid = f"{group}/{i}"
                ids.append(sid)
                life(sid, group, domain, step, 0.25 * (step + d + i), t_step + i + 2 * d, step=step,
                     trained_version=step)
        out.append(ev.TrainStep(run_id=run_id, ts=t_step + 12.0, step=step, policy_version=step, sample_ids=ids,
                                staleness_hist={0: 3, 1: 1},
                                metrics={"loss/policy": 0.1 / (step + 1), "rollout/reward_mean": 0.3 + 0.2 * step,
                                         "actor/approx_kl": 0.001 * step, "rollout/staleness_mean": 0.25,
                                         "perf/step_s": 1.5}))
        out.append(ev.WeightsPublished(run_id=run_id, ts=t_step + 12.5, policy_version=step + 1, step=step,
                                       uri=f"/w/v{step + 1}", checksum="ab" * 32, num_bytes=1024))
    out.append(ev.EvalResult(run_id=run_id, ts=t + 95.0, step=1, policy_version=2, split="heldout",
                             metrics={"eval/accuracy": 0.5, "eval/arith/accuracy": 0.75},
                             answers=[ev.EvalAnswer(domain="arith", prompt_id="h0", prompt="3+4=", reference="7",
                                                    response="7", correct=True),
                                      ev.EvalAnswer(domain="arith", prompt_id="h1", prompt="5+6=", reference="11",
                                                    response="12", correct=False)]))

    # a multi-turn episode of two actions
    t_ep = t + 100.0
    out += [
        ev.EnvReset(run_id=run_id, ts=t_ep + 0.25, episode_id="ep-1", sample_id="mt/0", env=ev.EnvSpec(name="countdown")),
        ev.EnvObservation(run_id=run_id, ts=t_ep + 0.5, episode_id="ep-1", step=0, observation="reach 7 from 3 4"),
        ev.EnvStep(run_id=run_id, ts=t_ep + 1.0, episode_id="ep-1", step=1, action="3*4", policy_version=2),
        ev.EnvObservation(run_id=run_id, ts=t_ep + 1.5, episode_id="ep-1", step=1, observation="12, not 7",
                          reward=0.0),
        ev.EnvStep(run_id=run_id, ts=t_ep + 2.0, episode_id="ep-1", step=2, action="3+4", policy_version=2),
        ev.EnvObservation(run_id=run_id, ts=t_ep + 2.75, episode_id="ep-1", step=2, observation="7: solved",
                          reward=1.0, terminated=True),
    ]
    life("mt/0", "mt", "countdown", 2, 1.0, t_ep - 0.5, step=2, trained_version=2, turns=2, env_s=1.5,
         episode_id="ep-1", env_finish="terminated")
    # samples that did not train, and one still in flight
    life("old/0", "old", "arith", 0, 0.5, t + 110.0, status="dropped_stale", reason="stale: gap 2 > 1",
         trained_version=2)
    life("flat/0", "flat", "math", 2, 0.0, t + 111.0, status="filtered", reason="all-equal rewards",
         trained_version=2)
    life("dead/0", "dead", "math", 2, 0.0, t + 112.0, until="issued")
    out.append(ev.DeadLetter(run_id=run_id, ts=t + 113.0, source_topic=topic_name(run_id, "tasks"), partition=0,
                             offset=3, key=b"dead/0", value=b"", error="handle: engine error: CUDA out of memory",
                             service="rollout", stage="handle", sample_id="dead/0"))
    out.append(ev.DeadLetter(run_id=run_id, ts=t + 114.0, source_topic=topic_name(run_id, "tasks"), partition=1,
                             offset=9, key=b"junk", value=b"\xc1", error="decode: invalid msgpack", service="rollout",
                             stage="decode"))
    life("late/0", "late", "arith", 2, 1.0, t + 115.0, until="scored")
    out.append(ev.RunFinished(run_id=run_id, ts=t + 120.0, status="completed"))
    return out


async def publish(bootstrap: str, run_id: str, events: list[ev.Event], *, junk: bool = True) -> int:
    """Create the run's topics and publish ``events`` in order (plus, with ``junk``, one
    undecodable message on ``tasks`` before the last event). Returns the messages sent."""
    settings = KafkaSettings(bootstrap=bootstrap)
    async with TopicAdmin(settings) as admin:
        await admin.ensure_run_topics(run_id)
    async with Producer(settings) as producer:
        for e in events[:-1]:
            await producer.send_and_wait(topic_name(run_id, topic_of(e)), e)
        if junk:
            await producer.raw.send_and_wait(topic_name(run_id, "tasks"), b"\xc1not msgpack", key=b"junk")
        if events:
            await producer.send_and_wait(topic_name(run_id, topic_of(events[-1])), events[-1])
    return len(events) + (1 if junk else 0)
