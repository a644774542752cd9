"""The ready queries of ``docs/analytics.md``, by name, in one place.

``rollstream sql --query NAME [RUN]`` runs one; every query takes the run as ``{run:String}``.
The doc shows each under a line ``rollstream sql --query NAME RUN``; :func:`render_doc` writes
the queries' text into those blocks (``python -m store.queries docs/analytics.md``) and
``tests/store/test_analytics_docs.py`` checks that the doc is rendered and that every query runs.
Each query's first line names the columns it returns (``-- columns: ...``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

QUERIES: dict[str, str] = {
    "reward-by-domain": """\
-- columns: domain, step, reward_mean, samples
SELECT domain, step, round(avg(reward), 4) AS reward_mean, count() AS samples
FROM samples
WHERE run_id = {run:String} AND status = 'trained' AND step >= 0
GROUP BY domain, step
ORDER BY domain, step
""",
    "staleness": """\
-- columns: versions_behind, samples
SELECT gap AS versions_behind, sum(n) AS samples
FROM train_steps FINAL
ARRAY JOIN mapKeys(staleness_hist) AS gap, mapValues(staleness_hist) AS n
WHERE run_id = {run:String}
GROUP BY gap
ORDER BY gap
""",
    "latency": """\
-- columns: stage, samples, mean_s, p50_s, p95_s
SELECT stage, count() AS samples, round(avg(s), 4) AS mean_s,
       round(quantile(0.5)(s), 4) AS p50_s, round(quantile(0.95)(s), 4) AS p95_s
FROM samples
ARRAY JOIN ['queue wait', 'generation', 'environment', 'reward wait', 'reward', 'training wait', 'total'] AS stage,
           [queue_s, gen_s, env_s, reward_wait_s, reward_s, train_wait_s, total_s] AS s
WHERE run_id = {run:String} AND s IS NOT NULL
GROUP BY stage
ORDER BY min(indexOf(['queue wait', 'generation', 'environment', 'reward wait', 'reward', 'training wait', 'total'], stage))
""",
    "slowest": """\
-- columns: sample_id, domain, status, total_s, queue_s, gen_s, reward_wait_s, reward_s, train_wait_s, response_len
SELECT sample_id, domain, status, round(total_s, 3) AS total_s, round(queue_s, 3) AS queue_s,
       round(gen_s, 3) AS gen_s, round(reward_wait_s, 3) AS reward_wait_s, round(reward_s, 3) AS reward_s,
       round(train_wait_s, 3) AS train_wait_s, response_len
FROM samples
WHERE run_id = {run:String} AND total_s IS NOT NULL
ORDER BY total_s DESC
LIMIT 10
""",
    "dead-letters": """\
-- columns: service, stage, reason, messages, samples, first_ts, last_ts
SELECT service, stage, substring(error, 1, 120) AS reason, count() AS messages,
       uniqExactIf(sample_id, sample_id != '') AS samples, min(ts) AS first_ts, max(ts) AS last_ts
FROM dlq FINAL
WHERE run_id = {run:String}
GROUP BY service, stage, reason
ORDER BY messages DESC, reason
""",
    "status": """\
-- columns: status, reason, samples
SELECT status, reason, count() AS samples
FROM samples
WHERE run_id = {run:String}
GROUP BY status, reason
ORDER BY samples DESC, status, reason
""",
    "episodes": """\
-- columns: domain, multi_turn, episodes, turns_mean, env_s_mean, total_reward_mean, terminated, truncated, env_errors, trained, succeeded, retried
SELECT domain, multi_turn, count() AS episodes, round(avg(num_turns), 2) AS turns_mean,
       round(avg(env_s), 4) AS env_s_mean, round(avg(total_reward), 4) AS total_reward_mean,
       countIf(terminated = 1) AS terminated, countIf(truncated = 1) AS truncated,
       sum(env_errors) AS env_errors, countIf(status = 'trained') AS trained,
       countIf(success = 1) AS succeeded, countIf(attempts > 1) AS retried
FROM episodes
WHERE run_id = {run:String}
GROUP BY domain, multi_turn
ORDER BY domain, multi_turn
""",
    "episode-events": """\
-- columns: episode_id, step, kind, text, reward, terminated, truncated, error, ts
SELECT e.episode_id AS episode_id, e.step AS step, e.kind AS kind, e.text AS text, e.reward AS reward,
       e.terminated AS terminated, e.truncated AS truncated, e.error AS error, e.ts AS ts
FROM env_events AS e FINAL
WHERE e.run_id = {run:String}
  AND e.episode_id = (SELECT episode_id FROM episodes WHERE run_id = {run:String} AND multi_turn = 1
                      ORDER BY num_turns DESC, sample_id LIMIT 1)
ORDER BY step, ts
""",
    "episode-endings": """\
-- columns: env_finish, episodes, share, succeeded
SELECT env_finish, count() AS episodes, round(count() / sum(count()) OVER (), 4) AS share,
       countIf(success = 1) AS succeeded
FROM sample_generations FINAL
WHERE run_id = {run:String} AND episode_id != ''
GROUP BY env_finish
ORDER BY episodes DESC
""",
    "turns": """\
-- columns: num_turns, episodes, share, succeeded, total_reward_mean
SELECT num_turns, count() AS episodes, round(count() / sum(count()) OVER (), 4) AS share,
       countIf(success = 1) AS succeeded, round(avg(total_reward), 4) AS total_reward_mean
FROM episodes
WHERE run_id = {run:String} AND multi_turn = 1 AND num_turns IS NOT NULL
GROUP BY num_turns
ORDER BY num_turns
""",
    "env-latency": """\
-- columns: env, answer, observations, p50_s, p90_s, p99_s, max_s, mean_s, failed
SELECT env, if(o.step = 0, 'reset', 'step') AS answer, count() AS observations,
       round(quantile(0.5)(o.env_s), 4) AS p50_s, round(quantile(0.9)(o.env_s), 4) AS p90_s,
       round(quantile(0.99)(o.env_s), 4) AS p99_s, round(max(o.env_s), 4) AS max_s,
       round(avg(o.env_s), 4) AS mean_s, countIf(o.failed = 1) AS failed
FROM (SELECT * FROM env_events FINAL WHERE run_id = {run:String} AND kind = 'EnvObservation') AS o
LEFT JOIN (SELECT episode_id, any(env) AS name FROM env_events FINAL
           WHERE run_id = {run:String} AND kind = 'EnvReset' GROUP BY episode_id) AS r ON r.episode_id = o.episode_id
ARRAY JOIN [if(r.name = '', '(unknown)', r.name), '(all)'] AS env
GROUP BY env, answer
ORDER BY env = '(all)', env, answer
""",
    "episode": """\
-- columns: step, action, policy_version, observation, reward, env_s, terminated, truncated, failed, error, episode_id
WITH (SELECT episode_id FROM episodes WHERE run_id = {run:String} AND multi_turn = 1
      ORDER BY num_turns DESC, sample_id LIMIT 1) AS episode
SELECT if(o.seen = 1, o.step, a.step) AS step, a.action AS action,
       if(a.seen = 1, a.version, NULL) AS policy_version, o.observation AS observation,
       if(o.seen = 1, o.reward, NULL) AS reward, if(o.seen = 1, o.env_s, NULL) AS env_s,
       o.terminated AS terminated, o.truncated AS truncated, o.failed AS failed, o.error AS error,
       episode AS episode_id
FROM (SELECT step, argMax(text, ts) AS action, argMax(policy_version, ts) AS version, toUInt8(1) AS seen
      FROM env_events FINAL
      WHERE run_id = {run:String} AND episode_id = episode AND kind = 'EnvStep'
      GROUP BY step) AS a
FULL JOIN
     (SELECT step, argMax(text, ts) AS observation, argMax(reward, ts) AS reward, argMax(env_s, ts) AS env_s,
             argMax(terminated, ts) AS terminated, argMax(truncated, ts) AS truncated,
             argMax(failed, ts) AS failed, argMax(error, ts) AS error, toUInt8(1) AS seen
      FROM env_events FINAL
      WHERE run_id = {run:String} AND episode_id = episode AND kind = 'EnvObservation'
      GROUP BY step) AS o
ON o.step = a.step
ORDER BY step
""",
    "curve": """\
-- columns: step, policy_version, reward_mean, loss_policy, approx_kl, staleness_mean, step_s, eval_accuracy
SELECT t.step AS step, t.policy_version AS policy_version,
       round(t.metrics['rollout/reward_mean'], 4) AS reward_mean, round(t.metrics['loss/policy'], 4) AS loss_policy,
       round(t.metrics['actor/approx_kl'], 5) AS approx_kl, round(t.metrics['rollout/staleness_mean'], 2) AS staleness_mean,
       round(t.metrics['perf/step_s'], 3) AS step_s, e.accuracy AS eval_accuracy
FROM (SELECT * FROM train_steps FINAL WHERE run_id = {run:String}) AS t
LEFT JOIN (SELECT step, toNullable(any(metrics['eval/accuracy'])) AS accuracy FROM evals FINAL
           WHERE run_id = {run:String} AND split = 'heldout' GROUP BY step) AS e ON e.step = t.step
ORDER BY step
""",
    "answers": """\
-- columns: step, domain, prompt, expected, answer, correct
SELECT JSONExtractInt(payload, 'step') AS step, JSONExtractString(a, 'domain') AS domain,
       JSONExtractString(a, 'prompt') AS prompt, JSONExtractString(a, 'reference') AS expected,
       JSONExtractString(a, 'response') AS answer, JSONExtractBool(a, 'correct') AS correct
FROM events FINAL
ARRAY JOIN JSONExtractArrayRaw(payload, 'answers') AS a
WHERE run_id = {run:String} AND kind = 'EvalResult' AND JSONExtractString(payload, 'split') = 'heldout'
ORDER BY step, domain, prompt
""",
    "recorder-lag": """\
-- columns: ts, lag_records, partitions, recorded_total, skipped_total
SELECT ts, lag_records, partitions, recorded_total, skipped_total
FROM recorder_lag
WHERE run_id = {run:String}
ORDER BY ts
""",
    "events": """\
-- columns: name, kind, events, first_ts, last_ts
SELECT name, kind, count() AS events, min(ts) AS first_ts, max(ts) AS last_ts
FROM events FINAL
WHERE run_id = {run:String}
GROUP BY name, kind
ORDER BY name, kind
""",
    "reward-components": """\
-- columns: domain, step, component, samples, mean
SELECT domain, step, component, count() AS samples, round(avg(value), 4) AS mean
FROM samples
ARRAY JOIN arrayConcat(['(reward)'], mapKeys(rewards)) AS component,
           arrayConcat([ifNull(reward, 0.)], mapValues(rewards)) AS value
WHERE run_id = {run:String} AND status = 'trained' AND step >= 0
GROUP BY domain, step, component
ORDER BY domain, step, component != '(reward)', component
""",
    "judge-agreement": """\
-- columns: step, samples, judged, unscored, compared, judge_if_correct, judge_if_wrong, agreement, corr
SELECT step, count() AS samples, countIf(judge != '') AS judged, countIf(judge_error != '') AS unscored,
       countIf(cmp) AS compared,
       round(avgIfOrNull(rewards['judge'], cmp AND rewards['correct'] >= 0.5), 4) AS judge_if_correct,
       round(avgIfOrNull(rewards['judge'], cmp AND rewards['correct'] < 0.5), 4) AS judge_if_wrong,
       round(avgIfOrNull((rewards['judge'] >= 0.5) = (rewards['correct'] >= 0.5), cmp), 4) AS agreement,
       round(if(isFinite(corrIf(rewards['correct'], rewards['judge'], cmp)),
                corrIf(rewards['correct'], rewards['judge'], cmp), NULL), 4) AS corr
FROM
(
    SELECT *, ifNull(judge != '' AND judge_error = '', 0) AND mapContains(rewards, 'correct') AS cmp
    FROM samples
    WHERE run_id = {run:String} AND step >= 0
)
GROUP BY step
ORDER BY step
""",
    "judge-latency": """\
-- columns: judge, domains, scored, unscored, p50_s, p90_s, p99_s, max_s, mean_s, verifier_mean_s
SELECT if(j = '', '(none)', j) AS judge, arraySort(groupUniqArray(domain)) AS domains, count() AS scored,
       countIf(judge_error != '') AS unscored,
       if(j = '', NULL, round(quantile(0.5)(judge_s), 4)) AS p50_s,
       if(j = '', NULL, round(quantile(0.9)(judge_s), 4)) AS p90_s,
       if(j = '', NULL, round(quantile(0.99)(judge_s), 4)) AS p99_s,
       if(j = '', NULL, round(max(judge_s), 4)) AS max_s,
       if(j = '', NULL, round(avg(judge_s), 4)) AS mean_s,
       round(avg(reward_s), 4) AS verifier_mean_s
FROM (SELECT *, assumeNotNull(judge) AS j FROM samples WHERE run_id = {run:String} AND reward IS NOT NULL)
GROUP BY j
ORDER BY j = '', j
""",
    "judge-failures": """\
-- columns: domain, judge, scored, judged, unscored, unscored_share, top_reasons
SELECT domain, judge, sum(n) AS scored, sumIf(n, judge != '') AS judged, sumIf(n, reason != '') AS unscored,
       round(if(judged = 0, NULL, unscored / judged), 4) AS unscored_share,
       arraySlice(arraySort(x -> (-x.2, x.1), groupArrayIf((reason, n), reason != '')), 1, 3) AS top_reasons
FROM
(
    SELECT domain, assumeNotNull(judge) AS judge,
           replaceRegexpAll(replaceRegexpOne(assumeNotNull(judge_error), ' [''"].*', ' <answer>'),
                            '[0-9]+([.][0-9]+)?', 'N') AS reason,
           count() AS n
    FROM samples
    WHERE run_id = {run:String} AND reward IS NOT NULL
    GROUP BY domain, judge, reason
)
GROUP BY domain, judge
ORDER BY domain, judge
""",
}
"""Query name -> SQL (ClickHouse dialect, one read-only statement)."""

_BLOCK = re.compile(r"`rollstream sql --query ([\w-]+) RUN`\n\n```sql\n(.*?)```", re.S)


class UnknownQuery(KeyError):
    """A name that is not one of :data:`QUERIES`; its message lists the names."""

    def __str__(self) -> str:
        return f"unknown query {self.args[0]!r}: one of {', '.join(QUERIES)}"


def query(name: str) -> str:
    """The SQL of the ready query ``name`` (:class:`UnknownQuery` otherwise)."""
    try:
        return QUERIES[name]
    except KeyError:
        raise UnknownQuery(name) from None


def doc_names(text: str) -> list[str]:
    """The names of the queries a doc shows, in order."""
    return [m.group(1) for m in _BLOCK.finditer(text)]


def render_doc(text: str) -> str:
    """``text`` with the ```sql block after each ``rollstream sql --query NAME RUN`` line
    replaced by that query (:class:`UnknownQuery` for a name that is not one)."""
    return _BLOCK.sub(lambda m: f"`rollstream sql --query {m.group(1)} RUN`\n\n```sql\n{query(m.group(1))}```", text)


if __name__ == "__main__":  # python -m store.queries docs/analytics.md: render the doc in place
    for arg in sys.argv[1:]:
        doc = Path(arg)
        doc.write_text(render_doc(doc.read_text()))
