"""One valid, deterministic instance of every event type (used by tests and fixtures)."""

from __future__ import annotations

import msgspec

from schemas import events as ev

RUN = "fixture-run"


def example_events() -> list[ev.Event]:
    task = ev.RolloutTask(
        run_id=RUN, event_id="e-task", ts=1700000000.0, sample_id="g1/0", group_id="g1", index=0,
        group_size=4, prompt_id="arith-17", domain="arith", prompt="12+7=", reference="19",
        env=ev.EnvSpec(name="arith", kwargs={"digits": 2}), policy_version=3, max_new_tokens=8, redundancy=1,
        system_prompt="Answer with a number.", baseline_index=5, image_hashes=["ab" * 32],
    )
    gen = ev.Generation(
        run_id=RUN, event_id="e-gen", ts=1700000001.0, task=task, prompt_ids=[1, 5, 6, 7], response_ids=[9, 10, 2],
        response_text="19", logprobs=[-0.5, 0.0, -0.125], loss_mask=[1, 0, 1], finish_reason="stop",
        policy_version=3, policy_version_end=4, worker_id="w0", queued_s=0.01, gen_s=0.2,
        env_s=0.5, num_turns=2, episode_id="g1/0@0a1b2c3d", step_rewards=[0.0, 1.0], turn_versions=[3, 4],
        state_hashes=["aa11", "bb22"], env_finish="terminated", success=True, segment_starts=[1],
        image_hashes=["ef" * 32], segment_image_hashes=[["ef" * 32], []],
    )
    scored = ev.ScoredSample(run_id=RUN, event_id="e-scored", ts=4.0, generation=gen, reward=1.0,
                             rewards={"correct": 1.0, "judge": 0.75}, verifier="exact", details="19 == 19",
                             policy_version=3, judge="quality", judge_s=0.125, judge_error="")
    return [
        task,
        ev.EnvReset(run_id=RUN, event_id="e-reset", ts=1.0, episode_id="ep1", sample_id="g1/0",
                    env=ev.EnvSpec(name="countdown"), seed=7),
        ev.EnvStep(run_id=RUN, event_id="e-step", ts=2.0, episode_id="ep1", step=2, action="3+4", policy_version=2,
                   history=["2*3"], env=ev.EnvSpec(name="countdown", kwargs={"n": 3}), seed=7),
        ev.EnvObservation(run_id=RUN, event_id="e-obs", ts=3.0, episode_id="ep1", step=2, observation="7",
                          reward=1.0, terminated=True, info={"ok": True}, env_s=0.25, failed=False,
                          image_hashes=["ef" * 32]),
        gen,
        scored,
        ev.JudgeRequest(run_id=RUN, event_id="e-judge", ts=4.5, judge="quality",
                        scored=msgspec.structs.replace(scored, rewards={"correct": 1.0}, judge="", judge_s=0.0)),
        ev.WeightsPublished(run_id=RUN, event_id="e-w", ts=5.0, policy_version=4, step=4, uri="/tmp/w/v4",
                            checksum="", num_bytes=1024, memory="/dev/shm/rollstream-fixture-run-0a1b2c3d-v00004-e5f6a7b8",
                            memory_host="node-a", memory_checksum="cd" * 32,
                            broadcast="gloo://10.0.0.7:29517"),
        ev.TrainStep(run_id=RUN, event_id="e-ts", ts=6.0, step=4, policy_version=3,
                     metrics={"loss/policy": 0.1, "rollout/reward_mean": 0.5}, sample_ids=["g1/0"],
                     staleness_hist={0: 3, 1: 1}),
        ev.SampleOutcome(run_id=RUN, event_id="e-out", ts=7.0, sample_id="g1/0", group_id="g1", status="trained",
                         policy_version=3, trained_version=4, step=4),
        ev.EvalResult(run_id=RUN, event_id="e-eval", ts=8.0, step=4, policy_version=4, split="heldout",
                      metrics={"eval/accuracy": 0.5},
                      answers=[ev.EvalAnswer(domain="see", prompt_id="shapes-7", prompt="What colour is the square?",
                                             reference="red", response="red", correct=True, image_hashes=["cd" * 32])]),
        ev.RunStarted(run_id=RUN, event_id="e-rs", ts=9.0, config_json="{}", host="h"),
        ev.RunFinished(run_id=RUN, event_id="e-rf", ts=10.0, status="completed", summary_json="{}"),
        ev.Pause(run_id=RUN, event_id="e-p", ts=11.0, reason="debug"),
        ev.Resume(run_id=RUN, event_id="e-r", ts=12.0),
        ev.Drain(run_id=RUN, event_id="e-d", ts=13.0, reason="end", origin="user"),
        ev.DeadLetter(run_id=RUN, event_id="e-dl", ts=14.0, source_topic="rs.x.tasks", partition=0, offset=5,
                      key=b"g1/0", value=b"\xff\x00", error="decode: bad bytes", service="rollout", stage="decode",
                      sample_id="g1/0", group_id="g1"),
        ev.ServiceStarted(run_id=RUN, event_id="e-ss", ts=15.0, service="rollout", pid=4321, host="h"),
        ev.ServiceRestarted(run_id=RUN, event_id="e-sr", ts=16.0, service="rollout", pid=4400, exit_code=-9,
                            restarts=1, reason="killed by SIGKILL", backoff_s=1.0, previous_pid=4321),
        ev.ServiceFailed(run_id=RUN, event_id="e-sf", ts=17.0, service="rollout", pid=4500, exit_code=1,
                         restarts=3, reason="exited with code 1: error: boom"),
    ]
