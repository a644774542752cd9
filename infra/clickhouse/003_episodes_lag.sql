-- Episodes, environment steps, recorder lag, and the per-stage latency columns of `samples`.
-- Every statement is idempotent (IF NOT EXISTS / OR REPLACE): apply_ddl re-runs them on each
-- open, so a store created before this file gets the new columns, tables and views on open.

-- Agent turns of the generation (1 for single-turn tasks); rows stored before 003 read 1.
ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS num_turns UInt32 DEFAULT 1 COMMENT 'Agent turns of the episode (1 for single-turn tasks)';

-- One row per environment event of a multi-turn episode (EnvReset, EnvStep, EnvObservation).
-- Only EnvReset names the sample: join the other kinds to it through episode_id.
CREATE TABLE IF NOT EXISTS env_events
(
    run_id         LowCardinality(String),
    episode_id     String                 COMMENT 'Episode the event belongs to',
    sample_id      String                 COMMENT 'Sample of the episode (EnvReset only, empty otherwise)',
    kind           LowCardinality(String) COMMENT 'EnvReset | EnvStep | EnvObservation',
    step           Int64                  COMMENT 'Turn: 0 for EnvReset and its observation, k for the k-th action and its observation',
    env            LowCardinality(String) COMMENT 'Environment name (EnvReset only, empty otherwise)',
    policy_version Int64                  COMMENT 'Weights version of the action (EnvStep), -1 otherwise',
    text           String                 COMMENT 'The action (EnvStep) or observation (EnvObservation), first 2000 characters',
    reward         Float64                COMMENT 'Reward of the step (EnvObservation), 0 otherwise',
    terminated     UInt8                  COMMENT '1 when the observation ends the episode',
    truncated      UInt8                  COMMENT '1 when the observation cuts the episode short (limit reached)',
    error          String                 COMMENT 'Non-empty when the environment failed on this step',
    event_id       String,
    ts             DateTime64(6)          COMMENT 'Event creation time'
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, episode_id, step, kind, event_id);

-- The recorder's consumer lag, measured every store.lag_report_every_s and at exit.
CREATE TABLE IF NOT EXISTS recorder_lag
(
    run_id         LowCardinality(String) COMMENT 'Run the recorder records (empty: every run)',
    group_id       String                 COMMENT 'Consumer group of the recorder',
    ts             DateTime64(6)          COMMENT 'When the lag was measured',
    lag_records    UInt64                 COMMENT 'Messages not yet recorded: end offsets minus positions, summed over the assigned partitions',
    partitions     UInt32                 COMMENT 'Partitions assigned to the recorder',
    recorded_total UInt64                 COMMENT 'Messages this recorder instance has stored so far',
    skipped_total  UInt64                 COMMENT 'Messages it skipped as already stored so far'
)
ENGINE = MergeTree ORDER BY (run_id, ts);

-- `samples` of 002 plus the sample's timestamps, total and reward-wait latency, generation
-- details and turns (new columns go last, so older queries keep working).
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
    if(o.sample_id = '', NULL, o.decided_ts) AS decided_ts
FROM (SELECT * FROM sample_tasks FINAL) AS t
LEFT JOIN (SELECT * FROM sample_generations FINAL) AS g ON g.run_id = t.run_id AND g.sample_id = t.sample_id
LEFT JOIN (SELECT * FROM sample_rewards FINAL) AS r ON r.run_id = t.run_id AND r.sample_id = t.sample_id
LEFT JOIN (SELECT * FROM sample_outcomes FINAL) AS o ON o.run_id = t.run_id AND o.sample_id = t.sample_id
LEFT JOIN (SELECT run_id, sample_id, any(error) AS error FROM dlq FINAL WHERE sample_id != '' GROUP BY run_id, sample_id) AS d
    ON d.run_id = t.run_id AND d.sample_id = t.sample_id;

-- One row per sample: its whole life as an episode. Multi-turn samples aggregate their
-- environment events (turns, environment time, rewards, how the episode ended); single-turn
-- samples (no environment events) take turns, env time and reward from the generation and the
-- verifier. Environment time of a turn = its observation's ts minus its request's ts.
CREATE OR REPLACE VIEW episodes AS
SELECT
    s.run_id AS run_id,
    s.sample_id AS sample_id,
    s.group_id AS group_id,
    s.domain AS domain,
    toUInt8(e.sample_id != '') AS multi_turn,
    e.episode_id AS episode_id,
    if(e.sample_id = '', s.num_turns, toUInt32(e.turns)) AS num_turns,
    if(e.sample_id = '', s.env_s, e.env_s) AS env_s,
    if(e.sample_id = '', s.reward, e.env_reward) AS total_reward,
    s.reward AS reward,
    if(e.sample_id = '', NULL, e.terminated) AS terminated,
    if(e.sample_id = '', NULL, e.truncated) AS truncated,
    e.env_errors AS env_errors,
    s.status AS status,
    s.reason AS reason,
    s.policy_version AS policy_version,
    s.step AS step,
    s.issued_ts AS issued_ts,
    s.total_s AS total_s
FROM samples AS s
LEFT JOIN
(
    SELECT
        ep.run_id AS run_id,
        ep.sample_id AS sample_id,
        argMax(ep.episode_id, ep.last_ts) AS episode_id,
        sum(ep.actions) AS turns,
        sum(tt.env_s) AS env_s,
        sum(ep.env_reward) AS env_reward,
        argMax(ep.terminated, ep.last_ts) AS terminated,
        argMax(ep.truncated, ep.last_ts) AS truncated,
        sum(ep.errors) AS env_errors
    FROM
    (
        SELECT
            run_id,
            episode_id,
            anyIf(sample_id, kind = 'EnvReset') AS sample_id,
            countIf(kind = 'EnvStep') AS actions,
            sumIf(reward, kind = 'EnvObservation') AS env_reward,
            countIf(error != '') AS errors,
            max(ts) AS last_ts,
            argMaxIf(terminated, (step, ts), kind = 'EnvObservation') AS terminated,
            argMaxIf(truncated, (step, ts), kind = 'EnvObservation') AS truncated
        FROM env_events FINAL
        GROUP BY run_id, episode_id
    ) AS ep
    LEFT JOIN
    (
        SELECT run_id, episode_id, sum(turn_s) AS env_s
        FROM
        (
            SELECT
                run_id,
                episode_id,
                step,
                if(countIf(kind != 'EnvObservation') > 0 AND countIf(kind = 'EnvObservation') > 0,
                   greatest(0., dateDiff('microsecond', minIf(ts, kind != 'EnvObservation'),
                                         maxIf(ts, kind = 'EnvObservation')) / 1e6),
                   0.) AS turn_s
            FROM env_events FINAL
            GROUP BY run_id, episode_id, step
        )
        GROUP BY run_id, episode_id
    ) AS tt ON tt.run_id = ep.run_id AND tt.episode_id = ep.episode_id
    WHERE ep.sample_id != ''
    GROUP BY ep.run_id, ep.sample_id
) AS e ON e.run_id = s.run_id AND e.sample_id = s.sample_id;
