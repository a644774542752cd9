"""bench/pipeline_ceiling.py: its stubs keep the events valid, its rate and profile helpers count right."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout.engine import GenerationRequest
from rollout.sampling import SamplingParams
from schemas import events as ev
from schemas.sanity import check_generation

# bench/ is a directory of scripts, not a package: load the module from its file (see test_policy_sim.py)
ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_pipeline_ceiling", ROOT / "bench" / "pipeline_ceiling.py")
assert _spec is not None and _spec.loader is not None
pc = sys.modules["bench_pipeline_ceiling"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


def generations(engine: object, ids: list[str], max_new_tokens: int = 24) -> list[ev.Generation]:
    """What the rollout worker emits for tasks ``ids`` answered by ``engine``."""
    async def go() -> list[ev.Generation]:
        out = []
        reqs = [GenerationRequest(i, engine.encode("47+38="), SamplingParams(max_new_tokens=max_new_tokens))  # type: ignore[attr-defined]
                for i in ids]
        async for c in engine.generate(reqs):  # type: ignore[attr-defined]
            task = ev.RolloutTask(run_id="r", sample_id=c.request_id, group_id="g000000", index=0, group_size=8,
                                  prompt_id="p", domain="arith", prompt="47+38=", reference="85", policy_version=0)
            out.append(ev.Generation(run_id="r", task=task, prompt_ids=c.prompt_ids, response_ids=c.token_ids,
                                     response_text=c.text, logprobs=c.logprobs, loss_mask=[1] * len(c.token_ids),
                                     finish_reason=c.finish_reason, policy_version=c.policy_version,
                                     policy_version_end=c.policy_version_end))
        return out
    return asyncio.run(go())


def test_the_instant_engine_answers_valid_generations_at_the_published_version(tmp_path: Path) -> None:
    strategy, engine = pc.NoTrainStrategy(), pc.InstantEngine()
    path, checksum = strategy.export_weights(tmp_path / "v00003")
    asyncio.run(engine.load_weights(path, 3))
    ids = [f"g000000/{i}" for i in range(8)]
    gens = generations(engine, ids)
    assert [g.task.sample_id for g in gens] == ids
    assert all(check_generation(g) is None for g in gens)
    assert {g.policy_version for g in gens} == {3}
    assert {g.response_text for g in gens} == {pc.RIGHT, pc.WRONG}  # a group gets both rewards
    assert len(checksum) == 64
    short = generations(engine, ids[:1], max_new_tokens=5)[0]
    assert (short.finish_reason, len(short.response_ids), short.response_text) == ("length", 5, gens[0].response_text[:5])


def test_the_instant_engine_refuses_weights_the_bench_did_not_publish(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=pc.MARKER):
        asyncio.run(pc.InstantEngine().load_weights(tmp_path, 1))


def test_the_instant_verifier_rewards_the_right_answer_only_through_the_real_scoring_path() -> None:
    import envs

    got = [envs.score_response(pc.instant_verify, text, "85").reward for text in (pc.RIGHT, pc.WRONG)]
    assert got == [1.0, 0.0]


def test_the_no_train_strategy_counts_steps_and_resumes_its_step(tmp_path: Path) -> None:
    s = pc.NoTrainStrategy()
    metrics = s.train_step([SimpleNamespace(loss_mask=[1, 1, 0]), SimpleNamespace(loss_mask=[1])])
    assert (s.step, metrics["train/tokens"]) == (1, 3.0)
    s.save_checkpoint(tmp_path / "ck")
    assert pc.NoTrainStrategy().load_checkpoint(tmp_path / "ck") == 1


def test_the_rate_counts_outcomes_after_the_skipped_steps_up_to_the_last() -> None:
    steps = [10.0, 11.0, 12.0, 14.0]
    outcomes = [10.5, 12.0, 12.5, 13.0, 14.0, 14.5]
    assert pc.window_rate(steps, outcomes, skip=2) == (3 / 2.0, 3, 2.0)  # (12, 14]: 12.5, 13, 14
    with pytest.raises(ValueError, match="3 training steps"):
        pc.window_rate(steps[:3], outcomes, skip=2)


def test_rows_are_today_alone_without_the_batching_key_else_before_and_after() -> None:
    assert [n for n, _ in pc.rows_to_run(None, None)] == ["today (one sample per record)"]
    assert pc.rows_to_run(64, None) == [("before: kafka.samples_per_record=1", ["kafka.samples_per_record=1"]),
                                        ("after: kafka.samples_per_record=64", ["kafka.samples_per_record=64"])]
    assert pc.rows_to_run(64, 8)[1][1] == ["kafka.samples_per_record=8"]


def test_the_profile_is_split_by_service_call_site_and_mechanism() -> None:
    proc = 'process 7:"python bench/pipeline_ceiling.py service {} --run r"'
    loop = "_run_once (asyncio/base_events.py:1);Handle._run (asyncio/events.py:2)"
    lines = [
        f"{proc.format('rollout')};{loop};KafkaIO.send_outputs (runtime/kafka_io.py:3);"
        "AIOKafkaConnection.send (aiokafka/conn.py:4);_SelectorSocketTransport.write (asyncio/selector_events.py:5) 3",
        f"{proc.format('rollout')};{loop};RolloutWorker.handle (services/rollout_worker.py:6);"
        "BaseEventLoop.create_task (asyncio/base_events.py:7) 2",
        f"{proc.format('rollout')};{loop};EpollSelector.select (selectors.py:8) 50",  # idle: left out
        f"{proc.format('recorder')};Recorder.insert (services/recorder.py:9);Connection.query (chdb/state/sqlitelike.py:1) 4",
        f"{proc.format('feeder')};<module> (x.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 9",  # start-up
        'process 8:"python -m cli service reward --run other";Handle._run (asyncio/events.py:2) 5',  # not the bench's
    ]
    sites, mechs = pc.profile_table(lines, lambda frames: "produce" if any("send_outputs" in f for f in frames) else None)
    assert {s: dict(v) for s, v in sites.items()} == {"rollout": {"produce": 3, "handler code (ours)": 2},
                                                      "recorder": {"store (chDB insert)": 4}}
    assert {s: dict(v) for s, v in mechs.items()} == {
        "rollout": {"socket writes (asyncio transport)": 3, "service handlers (ours; the bench's stubs apart)": 2},
        "recorder": {"chDB insert, rows (recorder's store)": 4}}


def test_a_service_profiled_before_its_exec_is_named_by_its_pid() -> None:
    # py-spy saw pid 9 between the supervisor's fork and the exec: its command line is the supervisor's
    lines = ['process 9:"python bench/pipeline_ceiling.py run main.yaml --run-id r";'
             "RewardRouter.handle (services/reward_router.py:1) 4",
             'process 10:"python bench/pipeline_ceiling.py run main.yaml --run-id r";Supervisor.follow (launch/supervisor.py:2) 1']
    sites, _ = pc.profile_table(lines, lambda frames: None, {9: "reward", 10: "supervisor", 11: None})
    assert {s: dict(v) for s, v in sites.items()} == {"reward": {"handler code (ours)": 4},
                                                      "supervisor": {"handler code (ours)": 1}}
    sites, _ = pc.profile_table(lines, lambda frames: None)  # no /proc labels: the command line decides
    assert {s: dict(v) for s, v in sites.items()} == {"supervisor": {"handler code (ours)": 5}}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's CPU affinity")
def test_the_wait_for_a_core_is_read_per_process_from_its_threads() -> None:
    _bus_spec = importlib.util.spec_from_file_location("bench_bus", ROOT / "bench" / "bus.py")
    assert _bus_spec is not None and _bus_spec.loader is not None
    bus = importlib.util.module_from_spec(_bus_spec)
    _bus_spec.loader.exec_module(bus)
    # three busy processes on one core: each is runnable for the whole second, on the core a third of it
    core = min(os.sched_getaffinity(0))
    spin = (f"import os, time; os.sched_setaffinity(0, {{{core}}}); t = time.time()\n"
            "while time.time() - t < 1.2: pass")
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.2)"])
    try:
        import time
        time.sleep(1.0)
        waits = [bus.runnable_wait_s(p.pid) for p in busy]
        idle_wait = bus.runnable_wait_s(idle.pid)
    finally:
        for p in [*busy, idle]:
            p.wait(10)
    assert sum(waits) > 1.0, waits  # about 2 s of the 3 processes' 3 s runnable were spent waiting
    assert idle_wait < 0.2 * min(waits), (idle_wait, waits)


@pytest.mark.bench
def test_the_bench_runs_and_ends_with_its_ceiling_line(bootstrap: str) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline_ceiling.py"), "--bootstrap", bootstrap,
                          "--seconds", "40", "--no-profile"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("pipeline ceiling: ") and last.endswith(" samples/s")
    assert int(last.split()[2]) > 0
