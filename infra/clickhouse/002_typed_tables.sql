-- Typed tables the recorder fills from the events it records (one row per fact), and the
-- `samples` view that joins a sample's life: issued -> generated -> scored -> outcome.
-- All are ReplacingMergeTree keyed so that re-ingesting the same event is harmless.

CREATE TABLE IF NOT EXISTS sample_tasks
(
    run_id         LowCardinality(String),
    sample_id      String,
    group_id       String,
    prompt_id      String,
    domain         LowCardinality(String),
    issued_version Int64          COMMENT 'Latest weights version the feeder had seen',
    issued_ts      DateTime64(6)  COMMENT 'When the feeder issued the task'
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, sample_id);

CREATE TABLE IF NOT EXISTS sample_generations
(
    run_id             LowCardinality(String),
    sample_id          String,
    policy_version     Int64   COMMENT 'Weights version at dispatch',
    policy_version_end Int64   COMMENT 'Weights version at completion',
    response_len       UInt32  COMMENT 'Generated tokens',
    finish_reason      LowCardinality(String),
    worker_id          LowCardinality(String),
    queued_s           Float64 COMMENT 'Task event -> generation start, seconds',
    gen_s              Float64 COMMENT 'Generation time, seconds',
    env_s              Float64 COMMENT 'Environment time (multi-turn), seconds',
    generated_ts       DateTime64(6)
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, sample_id);

CREATE TABLE IF NOT EXISTS sample_rewards
(
    run_id    LowCardinality(String),
    sample_id String,
    reward    Float64,
    rewards   Map(String, Float64) COMMENT 'Named reward components',
    verifier  LowCardinality(String),
    details   String,
    reward_s  Float64 COMMENT 'Verification time, seconds',
    scored_ts DateTime64(6)
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, sample_id);

CREATE TABLE IF NOT EXISTS sample_outcomes
(
    run_id          LowCardinality(String),
    sample_id       String,
    group_id        String,
    status          LowCardinality(String) COMMENT 'trained | dropped_stale | filtered | dead_letter',
    reason          String,
    policy_version  Int64,
    trained_version Int64 COMMENT 'Trainer version when it decided',
    step            Int64 COMMENT 'Trainer step that consumed it, -1 if none',
    decided_ts      DateTime64(6)
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, sample_id, status, step);

CREATE TABLE IF NOT EXISTS train_steps
(
    run_id         LowCardinality(String),
    step           Int64,
    policy_version Int64 COMMENT 'Version the step trained (weights before the update)',
    ts             DateTime64(6),
    metrics        Map(String, Float64) COMMENT 'Every metric of the step by its stable name, e.g. metrics[''loss/policy'']',
    staleness_hist Map(Int64, UInt64)   COMMENT 'version gap -> samples in the batch',
    num_samples    UInt32
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, step);

CREATE TABLE IF NOT EXISTS evals
(
    run_id         LowCardinality(String),
    step           Int64,
    policy_version Int64,
    split          LowCardinality(String),
    ts             DateTime64(6),
    metrics        Map(String, Float64)
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, split, step);

CREATE TABLE IF NOT EXISTS weights
(
    run_id         LowCardinality(String),
    policy_version Int64,
    step           Int64,
    uri            String,
    format         LowCardinality(String),
    checksum       String,
    num_bytes      UInt64,
    ts             DateTime64(6)
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, policy_version);

CREATE TABLE IF NOT EXISTS dlq
(
    run_id       LowCardinality(String),
    source_topic String,
    partition    UInt32,
    offset       UInt64,
    sample_id    String,
    service      LowCardinality(String),
    stage        LowCardinality(String),
    error        String,
    ts           DateTime64(6)
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, source_topic, partition, offset, service);

CREATE VIEW IF NOT EXISTS samples AS
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
    t.issued_ts AS issued_ts
FROM (SELECT * FROM sample_tasks FINAL) AS t
LEFT JOIN (SELECT * FROM sample_generations FINAL) AS g ON g.run_id = t.run_id AND g.sample_id = t.sample_id
LEFT JOIN (SELECT * FROM sample_rewards FINAL) AS r ON r.run_id = t.run_id AND r.sample_id = t.sample_id
LEFT JOIN (SELECT * FROM sample_outcomes FINAL) AS o ON o.run_id = t.run_id AND o.sample_id = t.sample_id
LEFT JOIN (SELECT run_id, sample_id, any(error) AS error FROM dlq FINAL WHERE sample_id != '' GROUP BY run_id, sample_id) AS d
    ON d.run_id = t.run_id AND d.sample_id = t.sample_id;
