-- LLM-as-a-judge and reward-model scoring: which judge scored a sample, how long its call took
-- and why it gave no score (ScoredSample.judge / judge_s / judge_error), plus the sample's reward
-- components, verifier and judge in the `samples` view. Idempotent: apply_ddl re-runs it on each
-- open; rows stored before 007 read the defaults ('', 0, '').

ALTER TABLE sample_rewards ADD COLUMN IF NOT EXISTS judge LowCardinality(String) DEFAULT '' COMMENT 'Judge (judge.models) that scored the sample; empty = no judge';
ALTER TABLE sample_rewards ADD COLUMN IF NOT EXISTS judge_s Float64 DEFAULT 0 COMMENT 'Seconds the judge call took (its batch forward pass or its generated answer); 0 without a judge';
ALTER TABLE sample_rewards ADD COLUMN IF NOT EXISTS judge_error String DEFAULT '' COMMENT 'Why the judge gave no score (unparseable answer, judge failure; rewards[''judge''] is then 0); empty = scored';

-- `samples` of 003 (every column, same order) plus the reward components, verifier and judge.
CREATE OR REPLACE VIEW samples AS
SELECT
    t.run_id AS run_id,
    t.sample_id AS sample_id,
    t.group_id AS group_id,
    t.domain AS domain,
    t.issued_version AS issued_version,
    if(g.sample_id = '', -1, g.policy_version) AS policy_version,
    if(o.sample_id = '', -1, o.trained_version) AS trained_version,
    multiIf(o.sample_id != '', o.status, d.sample_id != '', 'dead_letter',
            r.sample_id != '', 'scored', g.sample_id != '', 'generated', 'issued') AS status,
    multiIf(o.sample_id != '', o.reason, d.sample_id != '', d.error, '') AS reason,
    if(r.sample_id = '', NULL, r.reward) AS reward,
    if(g.sample_id = '', NULL, g.response_len) AS response_len,
    if(g.sample_id = '', NULL, g.queued_s) AS queue_s,
    if(g.sample_id = '', NULL, g.gen_s) AS gen_s,
    if(g.sample_id = '', NULL, g.env_s) AS env_s,
    if(r.sample_id = '', NULL, r.reward_s) AS reward_s,
    if(o.sample_id = '' OR r.sample_id = '', NULL,
       dateDiff('microsecond', r.scored_ts, o.decided_ts) / 1e6) AS train_wait_s,
    if(o.sample_id = '', -1, o.step) AS step,
    t.issued_ts AS issued_ts,
    t.prompt_id AS prompt_id,
    if(g.sample_id = '', NULL, g.num_turns) AS num_turns,
    if(g.sample_id = '', NULL, g.finish_reason) AS finish_reason,
    if(g.sample_id = '', NULL, g.worker_id) AS worker_id,
    if(g.sample_id = '' OR r.sample_id = '', NULL,
       greatest(0., dateDiff('microsecond', g.generated_ts, r.scored_ts) / 1e6 - r.reward_s)) AS reward_wait_s,
    if(o.sample_id = '', NULL, dateDiff('microsecond', t.issued_ts, o.decided_ts) / 1e6) AS total_s,
    if(g.sample_id = '', NULL, g.generated_ts) AS generated_ts,
    if(r.sample_id = '', NULL, r.scored_ts) AS scored_ts,
    if(o.sample_id = '', NULL, o.decided_ts) AS decided_ts,
    r.rewards AS rewards,
    if(r.sample_id = '', NULL, r.verifier) AS verifier,
    if(r.sample_id = '', NULL, r.judge) AS judge,
    if(r.sample_id = '', NULL, r.judge_s) AS judge_s,
    if(r.sample_id = '', NULL, r.judge_error) AS judge_error
FROM (SELECT * FROM sample_tasks FINAL) AS t
LEFT JOIN (SELECT * FROM sample_generations FINAL) AS g ON g.run_id = t.run_id AND g.sample_id = t.sample_id
LEFT JOIN (SELECT * FROM sample_rewards FINAL) AS r ON r.run_id = t.run_id AND r.sample_id = t.sample_id
LEFT JOIN (SELECT * FROM sample_outcomes FINAL) AS o ON o.run_id = t.run_id AND o.sample_id = t.sample_id
LEFT JOIN (SELECT run_id, sample_id, any(error) AS error FROM dlq FINAL WHERE sample_id != '' GROUP BY run_id, sample_id) AS d
    ON d.run_id = t.run_id AND d.sample_id = t.sample_id;
