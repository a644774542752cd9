"""End to end: `rollstream run` on a short config through the real broker and the real store,
then the invariants of the record checked in SQL (a subprocess per CLI call, as a user runs it)."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import pytest

from tests.e2e.faults import assert_accounted, rollstream, sql

pytestmark = pytest.mark.slow

SHORT = [
    "train.steps=4", "train.warmup_sft_steps=10", "train.eval_every=2", "train.checkpoint_every=2",
    "data.heldout_size=16", "rollout.group_size=4", "train.batch_size=16", "train.micro_batch_size=16",
]



def dump_record(runs: Path, run_id: str, env: dict[str, str], store: str = "") -> dict[str, list[str]]:
    """Every table of a run's record as sorted JSON rows (tests/store/record_tables.py), through
    ``rollstream sql`` (the run's store, or ``store``)."""
    from tests.store.record_tables import COLUMNS_QUERY, by_table, columns_of, dump_query

    where = ["--store", store] if store else ["--run", run_id, "--runs-dir", str(runs)]
    res = rollstream("sql", COLUMNS_QUERY, *where, "--format", "json", env=env)
    assert res.returncode == 0, res.stderr
    res = rollstream("sql", dump_query(columns_of(json.loads(res.stdout)), run_id), *where, "--format", "json", env=env)
    assert res.returncode == 0, res.stderr
    return by_table(json.loads(res.stdout))


@pytest.mark.parametrize("async_ratio", ["1", "0"])
def test_short_run_accounts_for_every_sample(tmp_path: Path, bootstrap: str, repo_root: Path, async_ratio: str) -> None:
    """async 1 records live, and a record built later from its topics equals the live one table by
    table; async 0 runs without a live recorder (store.record_live=false: summary.json from the
    topics) and every check of the record below runs on the one `rollstream record` builds after."""
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-async{async_ratio}-{uuid.uuid4().hex[:6]}"  # unique: a long-lived broker keeps old runs
    sampled = ["train.eval_samples=2"] if async_ratio == "0" else []  # mean@2 beside the greedy accuracy
    handoff = "disk" if async_ratio == "1" else "auto"  # auto: shared memory (one node)
    live = async_ratio == "1"
    # on-policy, one device: the engine gives back its KV cache and weights while the trainer steps
    release = ["rollout.release_between_steps=kv_and_weights"] if async_ratio == "0" else []
    # the trainer also serves its versions to other nodes (none here: its engines copy from its node)
    broadcast = ["train.weights_broadcast=gloo"] if handoff == "auto" else []
    res = rollstream("run", str(repo_root / "examples" / "main.yaml"), "--run-id", run_id,
                     *[a for kv in [*SHORT, *sampled, *release, *broadcast, f"rollout.async_ratio={async_ratio}", f"run.runs_dir={runs}",
                                    f"train.weights_handoff={handoff}", f"store.record_live={str(live).lower()}"]
                       for a in ("--set", kv)], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    if live:  # the record of the recorder, and one built later from the topics: the same, table by table
        later = f"chdb://{tmp_path / 'later'}"
        built = rollstream("record", run_id, "--store", later, "--runs-dir", str(runs), "--format", "json", env=env)
        assert built.returncode == 0, built.stderr
        assert json.loads(built.stdout)["finished"]
        recorded, rebuilt = dump_record(runs, run_id, env), dump_record(runs, run_id, env, later)
        assert set(recorded) == set(rebuilt) and len(recorded["events"]) > 100
        for table in sorted(recorded):
            assert recorded[table] == rebuilt[table], table
    else:  # no recorder ran: summary.json came from the topics; the record is built now
        assert not (runs / run_id / "logs" / "recorder.log").exists() and not (runs / run_id / "store").exists()
        assert f"`rollstream record {run_id}` builds it" in res.stdout
        built = rollstream("record", run_id, "--runs-dir", str(runs), env=env)
        assert built.returncode == 0 and f"recorded run {run_id} into chdb://{runs.resolve() / run_id / 'store'}" \
            in built.stdout, built.stdout + built.stderr
    # the rollout workers swapped every version in from shared memory, or by disk; none is left in /dev/shm
    from weights.shm import SHM_DIR, segment_prefix

    swaps = [m for log in (runs / run_id / "logs").glob("rollout*.log")
             for m in re.findall(r"now at policy version (\d+) \(from ([a-z ]+)\)", log.read_text())]
    assert {src for _, src in swaps} == {"disk" if handoff == "disk" else "shared memory"}, swaps
    assert len({v for v, _ in swaps}) >= 3, swaps
    assert not list(SHM_DIR.glob(f"{segment_prefix(runs / run_id)}-*"))
    if broadcast:
        assert "weights served to engines on other nodes at gloo://" in (runs / run_id / "logs" / "trainer.log").read_text()
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 4
    # the trained model: named by the summary, the policy after the last step, loadable as it is
    from transformers import AutoModelForCausalLM

    from weights import read_weights, weights_match

    assert summary["final_model"] == str(runs / run_id / "final") and f"final model: {runs / run_id}" in res.stdout
    assert weights_match(summary["final_model"], read_weights(runs / run_id / "weights" / "v00004"))
    assert weights_match(summary["final_model"], AutoModelForCausalLM.from_pretrained(summary["final_model"]).state_dict())
    if live:  # the record was compacted when the recorder stopped
        assert "record compacted:" in (runs / run_id / "logs" / "recorder.log").read_text()
    evals = sql(f"SELECT split, mapContains(metrics, 'eval/accuracy_sampled') AS has FROM evals FINAL "
                f"WHERE run_id = '{run_id}'", runs, run_id, env)
    assert len(evals) >= 3 and all(e["has"] == bool(sampled) for e in evals)
    if sampled:
        assert 0 <= summary["eval"]["final"]["accuracy_sampled"] <= 1
        assert "held-out sampled accuracy (train.eval_samples=2)" in res.stdout
    else:
        assert "accuracy_sampled" not in summary["eval"]["final"]
    s = summary["samples"]
    assert s["issued"] > 0 and s["trained"] >= 4 * 16 - 16  # a group may be cut by staleness
    assert s["unaccounted"] == 0
    assert_accounted(s)
    if not live:  # what summary.json counted on the topics is what the record built later holds
        counted = sql(f"SELECT status, count() AS n FROM samples WHERE run_id = '{run_id}' GROUP BY status",
                      runs, run_id, env)
        assert {r["status"]: r["n"] for r in counted} == {k: v for k, v in s.items() if k not in ("issued", "unaccounted") and v}

    # every issued sample has exactly one terminal status in the record
    open_rows = sql(
        f"SELECT sample_id, status FROM samples WHERE run_id = '{run_id}' AND status NOT IN "
        "('trained', 'dropped_stale', 'filtered', 'dead_letter')", runs, run_id, env)
    assert open_rows == []
    # no sample trained twice
    twice = sql(f"SELECT sample_id, count() AS n FROM sample_outcomes FINAL WHERE run_id = '{run_id}' "
                "AND status = 'trained' GROUP BY sample_id HAVING n > 1", runs, run_id, env)
    assert twice == []
    # no trained sample older than max_staleness (1)
    stale = sql(f"SELECT sample_id FROM samples WHERE run_id = '{run_id}' AND status = 'trained' "
                "AND trained_version - policy_version > 1", runs, run_id, env)
    assert stale == []
    # weight versions go up by one per step, and rollout used them
    versions = sql(f"SELECT policy_version FROM weights FINAL WHERE run_id = '{run_id}' ORDER BY policy_version",
                   runs, run_id, env)
    assert [v["policy_version"] for v in versions] == list(range(5))
    used = sql(f"SELECT DISTINCT policy_version FROM sample_generations FINAL WHERE run_id = '{run_id}' "
               "ORDER BY policy_version", runs, run_id, env)
    assert {u["policy_version"] for u in used} >= {0, 1, 2, 3}
    steps = sql(f"SELECT step, policy_version FROM train_steps FINAL WHERE run_id = '{run_id}' ORDER BY step",
                runs, run_id, env)
    assert [(r["step"], r["policy_version"]) for r in steps] == [(i, i) for i in range(4)]
    if async_ratio == "0":
        # synchronous: every trained sample was generated by the version it trained
        lag = sql(f"SELECT count() AS n FROM samples WHERE run_id = '{run_id}' AND status = 'trained' "
                  "AND trained_version != policy_version", runs, run_id, env)
        assert lag[0]["n"] == 0
        ratio = sql(f"SELECT max(abs(metrics['actor/ratio_mean'] - 1)) AS d FROM train_steps FINAL "
                    f"WHERE run_id = '{run_id}'", runs, run_id, env)
        assert ratio[0]["d"] < 1e-3  # the weights the engine took back are the trainer's
        released = [int(n) for log in (runs / run_id / "logs").glob("rollout*.log")
                    for n in re.findall(r"engine memory released (\d+) time", log.read_text())]
        assert released and sum(released) >= 4, released  # at least once per version
    peaks = sql(f"SELECT min(metrics['perf/peak_memory_gib']) AS trainer, "
                f"min(metrics['perf/rollout_peak_memory_gib']) AS rollout FROM train_steps FINAL "
                f"WHERE run_id = '{run_id}'", runs, run_id, env)
    assert peaks[0]["trainer"] > 0 and peaks[0]["rollout"] > 0  # peak RSS of each process (CPU)


CHAT_DOMAINS = (
    "data.domains=["
    "{name: sums, source: reasoning_gym, kwargs: {dataset: chain_sum, min_terms: 2, max_terms: 2, max_digits: 1},"
    " answer: tag, format_reward: 0.1, ratio: 1},"
    "{name: arith, source: arith, kwargs: {max_value: 20, heldout_fraction: 0.2}, answer: auto, ratio: 1,"
    " system_prompt: 'Reply with <answer>N</answer>.'}]"
)


def test_chat_model_with_mixed_domains_answer_tags_and_tensorboard(tmp_path: Path, bootstrap: str,
                                                                     repo_root: Path) -> None:
    """A BPE model with a ChatML template, prompts through the template (a system prompt per model and
    per domain), two domains (reasoning-gym and arith) scored from <answer> tags with a format reward,
    a stop string, and TensorBoard files: the run completes and the record shows each part."""
    from rollout.model_init import load_tokenizer

    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-chat-{uuid.uuid4().hex[:6]}"
    sets = [*SHORT, "train.steps=3", f"run.runs_dir={runs}", "model.init.tokenizer=bpe",
            "model.init.chat_template=true", "model.init.max_position_embeddings=320", "model.chat_template=true",
            "model.system_prompt=Answer inside <answer></answer> tags.", CHAT_DOMAINS,
            "rollout.stop=['</answer>']", "tracking.tensorboard=true"]
    res = rollstream("run", str(repo_root / "examples" / "main.yaml"), "--run-id", run_id,
                     *[a for kv in sets for a in ("--set", kv)], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "devices: rollout on cpu (float32), trainer on cpu (float32)" in res.stdout + res.stderr
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["samples"]["unaccounted"] == 0

    # both domains were sampled, trained and scored with their format component
    rows = sql(f"SELECT s.domain AS domain, count() AS n, min(r.rewards['format']) AS fmin, "
               f"max(r.rewards['format']) AS fmax, countIf(r.details LIKE 'format missing:%') AS missing, "
               f"countIf(r.rewards['format'] = 0) AS nofmt, countIf(r.rewards['format'] = 1 AND r.reward < 0.1) AS cheap "
               f"FROM samples AS s JOIN (SELECT * FROM sample_rewards FINAL) AS r "
               f"ON r.run_id = s.run_id AND r.sample_id = s.sample_id WHERE s.run_id = '{run_id}' "
               f"AND s.status = 'trained' GROUP BY domain ORDER BY domain", runs, run_id, env)
    assert [r["domain"] for r in rows] == ["arith", "sums"]
    for r in rows:
        assert r["n"] > 0 and r["fmin"] in (0, 1) and r["fmax"] in (0, 1)
        assert r["missing"] == r["nofmt"]  # no format <=> the reason is recorded
    sums = rows[1]
    assert sums["cheap"] == 0  # with the format, the reward includes format_reward 0.1
    evals = sql(f"SELECT metrics FROM evals WHERE run_id = '{run_id}' AND split = 'heldout' ORDER BY step",
                runs, run_id, env)
    assert {"eval/sums/accuracy", "eval/arith/accuracy", "eval/accuracy"} <= set(evals[-1]["metrics"])

    # prompts went through the chat template with the right system turn per domain
    gens = sql(f"SELECT payload FROM events WHERE run_id = '{run_id}' AND kind = 'Generation' LIMIT 40",
               runs, run_id, env)
    tok = load_tokenizer(runs / run_id / "model")
    seen = set()
    for g in gens:
        payload = json.loads(g["payload"])
        text = tok.decode(payload["prompt_ids"])
        domain = payload["task"]["domain"]
        system = "Reply with <answer>N</answer>." if domain == "arith" else "Answer inside <answer></answer> tags."
        assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"), text
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        response = tok.decode(payload["response_ids"], skip_special_tokens=True)
        if payload["finish_reason"] == "stop" and "</answer>" in response:
            assert response.endswith("</answer>") or response.rstrip().endswith("</answer>")
        seen.add(domain)
    assert seen == {"arith", "sums"}
    assert list((runs / run_id / "tb").glob("events.out.tfevents.*"))  # TensorBoard files were written
