-- Multi-turn episodes as the rollout workers and environment workers now report them: the
-- environment worker's own latency and failures per answer (EnvObservation.env_s / failed), the
-- episode fields of Generation, and an `episodes` view that reads one episode per sample (the
-- attempt its generation names). Idempotent: apply_ddl re-runs it on each open; rows stored
-- before 006 read the defaults (0, '', []).

ALTER TABLE env_events ADD COLUMN IF NOT EXISTS env_s Float64 DEFAULT 0 COMMENT 'Seconds the environment worker spent on the answer, simulated latency included (EnvObservation), 0 otherwise';
ALTER TABLE env_events ADD COLUMN IF NOT EXISTS failed UInt8 DEFAULT 0 COMMENT '1 when the episode ended as failed on this step (EnvObservation)';

ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS episode_id String DEFAULT '' COMMENT 'Multi-turn: the episode (attempt) the generation played, <sample_id>@<8 hex>; empty for single-turn';
ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS env_finish LowCardinality(String) DEFAULT '' COMMENT 'Multi-turn: terminated | truncated | max_turns | context | env_error; empty for single-turn';
ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS env_error String DEFAULT '' COMMENT 'Multi-turn: why the environment failed, one line';
ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS success UInt8 DEFAULT 0 COMMENT 'Multi-turn: the environment reported success when the episode ended';
ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS step_rewards Array(Float64) COMMENT 'Multi-turn: the environment reward of each agent turn, in order';
ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS turn_versions Array(Int64) COMMENT 'Multi-turn: the weights version each agent turn was generated with';
ALTER TABLE sample_generations ADD COLUMN IF NOT EXISTS state_hashes Array(String) COMMENT 'Multi-turn: the environment state each agent turn acted from (GiGPO step anchors)';

-- One row per sample: its whole life as an episode (columns of 003 first, new ones last).
--
-- A multi-turn sample (its generation names an episode, or an EnvReset names the sample) reads
-- ONE episode: the one its generation names, else (no generation yet, or one recorded before
-- Generation.episode_id) the sample's latest episode. Earlier attempts of the sample (a retried
-- episode has a new episode_id) only count in `attempts`. Per step, the latest action and the
-- latest observation count (a re-sent request is not a second turn).
-- env_s = the observations' env_s summed (what the environment worker measured); an episode
-- whose observations carry none (recorded before EnvObservation.env_s) falls back to env_wait_s.
-- env_wait_s = per step, its observation's ts minus its request's ts, summed (transport included).
-- num_turns, success, env_finish, env_error come from the generation (num_turns: the episode's
-- actions while not generated). A generation naming an episode of which no environment events were
-- recorded gives env_s, total_reward (step_rewards summed) and terminated/truncated (env_finish).
-- Single-turn samples take turns, env time and reward from the generation and the verifier.
CREATE OR REPLACE VIEW episodes AS
SELECT
    s.run_id AS run_id,
    s.sample_id AS sample_id,
    s.group_id AS group_id,
    s.domain AS domain,
    toUInt8(e.sample_id != '' OR g.episode_id != '') AS multi_turn,
    if(g.episode_id != '', g.episode_id, e.episode_id) AS episode_id,
    multiIf(g.sample_id != '', toNullable(g.num_turns), e.usable = 1, toNullable(toUInt32(e.turns)),
            NULL) AS num_turns,
    multiIf(e.usable = 1, toNullable(if(e.worker_env_s > 0, e.worker_env_s, e.wait_s)),
            g.episode_id != '', toNullable(g.env_s), s.env_s) AS env_s,
    multiIf(e.usable = 1, toNullable(e.env_reward), g.episode_id != '', toNullable(arraySum(g.step_rewards)),
            s.reward) AS total_reward,
    s.reward AS reward,
    multiIf(e.usable = 1, toNullable(e.terminated), g.episode_id != '', toNullable(toUInt8(g.env_finish = 'terminated')),
            NULL) AS terminated,
    multiIf(e.usable = 1, toNullable(e.truncated), g.episode_id != '', toNullable(toUInt8(g.env_finish = 'truncated')),
            NULL) AS truncated,
    if(e.usable = 1, e.env_errors, 0) AS env_errors,
    s.status AS status,
    s.reason AS reason,
    s.policy_version AS policy_version,
    s.step AS step,
    s.issued_ts AS issued_ts,
    s.total_s AS total_s,
    if(g.env_finish != '', toNullable(g.success), NULL) AS success,
    g.env_finish AS env_finish,
    g.env_error AS env_error,
    e.attempts AS attempts,
    if(e.usable = 1, toNullable(e.wait_s), NULL) AS env_wait_s
FROM samples AS s
LEFT JOIN (SELECT * FROM sample_generations FINAL) AS g ON g.run_id = s.run_id AND g.sample_id = s.sample_id
LEFT JOIN
(
    -- the chosen episode of each sample: the one its generation names, else the latest
    SELECT
        ep.run_id AS run_id,
        ep.sample_id AS sample_id,
        argMax(ep.episode_id, (ep.episode_id = gn.episode_id, ep.last_ts)) AS episode_id,
        argMax(ep.turns, (ep.episode_id = gn.episode_id, ep.last_ts)) AS turns,
        argMax(ep.worker_env_s, (ep.episode_id = gn.episode_id, ep.last_ts)) AS worker_env_s,
        argMax(ep.wait_s, (ep.episode_id = gn.episode_id, ep.last_ts)) AS wait_s,
        argMax(ep.env_reward, (ep.episode_id = gn.episode_id, ep.last_ts)) AS env_reward,
        argMax(ep.terminated, (ep.episode_id = gn.episode_id, ep.last_ts)) AS terminated,
        argMax(ep.truncated, (ep.episode_id = gn.episode_id, ep.last_ts)) AS truncated,
        argMax(ep.errors, (ep.episode_id = gn.episode_id, ep.last_ts)) AS env_errors,
        argMax(ep.episode_id = gn.episode_id OR gn.episode_id = '', (ep.episode_id = gn.episode_id, ep.last_ts))
            AS usable,
        count() AS attempts
    FROM
    (
        -- one row per episode: its sample (from the EnvReset, else from the id <sample_id>@<8 hex>)
        SELECT
            run_id,
            episode_id,
            if(anyIf(reset_sample, reset_sample != '') != '', anyIf(reset_sample, reset_sample != ''),
               if(match(episode_id, '@[0-9a-f]{8}$'), substring(episode_id, 1, length(episode_id) - 9), ''))
                AS sample_id,
            countIf(acted) AS turns,
            sum(obs_env_s) AS worker_env_s,
            sum(wait_s) AS wait_s,
            sum(obs_reward) AS env_reward,
            argMaxIf(obs_terminated, step, observed) AS terminated,
            argMaxIf(obs_truncated, step, observed) AS truncated,
            countIf(obs_error != '') AS errors,
            max(last_ts) AS last_ts
        FROM
        (
            -- one row per step of an episode: its request(s) and the latest observation
            SELECT
                run_id,
                episode_id,
                step,
                anyIf(sample_id, kind = 'EnvReset') AS reset_sample,
                countIf(kind = 'EnvStep') > 0 AS acted,
                countIf(kind = 'EnvObservation') > 0 AS observed,
                argMaxIf(env_s, ts, kind = 'EnvObservation') AS obs_env_s,
                argMaxIf(reward, ts, kind = 'EnvObservation') AS obs_reward,
                argMaxIf(terminated, ts, kind = 'EnvObservation') AS obs_terminated,
                argMaxIf(truncated, ts, kind = 'EnvObservation') AS obs_truncated,
                argMaxIf(error, ts, kind = 'EnvObservation') AS obs_error,
                if(countIf(kind != 'EnvObservation') > 0 AND countIf(kind = 'EnvObservation') > 0,
                   greatest(0., dateDiff('microsecond', minIf(ts, kind != 'EnvObservation'),
                                         maxIf(ts, kind = 'EnvObservation')) / 1e6),
                   0.) AS wait_s,
                max(ts) AS last_ts
            FROM env_events FINAL
            GROUP BY run_id, episode_id, step
        )
        GROUP BY run_id, episode_id
    ) AS ep
    LEFT JOIN (SELECT run_id, sample_id, episode_id FROM sample_generations FINAL) AS gn
        ON gn.run_id = ep.run_id AND gn.sample_id = ep.sample_id
    WHERE ep.sample_id != ''
    GROUP BY ep.run_id, ep.sample_id
) AS e ON e.run_id = s.run_id AND e.sample_id = s.sample_id;
