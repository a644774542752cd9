-- Service lifecycle of a run: one row per ServiceStarted / ServiceRestarted / ServiceFailed the
-- supervisor (`rollstream run`) published on the run's `control` topic.
-- Idempotent: apply_ddl re-runs it on each open.
CREATE TABLE IF NOT EXISTS service_events
(
    run_id       LowCardinality(String),
    service      LowCardinality(String) COMMENT 'Service label: recorder, feeder, reward, rollout (rollout0... with several workers), trainer',
    kind         LowCardinality(String) COMMENT 'ServiceStarted | ServiceRestarted | ServiceFailed',
    pid          UInt32                 COMMENT 'OS process id: the started or restarted process; for ServiceFailed the one that ended',
    previous_pid UInt32                 COMMENT 'ServiceRestarted: the process that ended (0 otherwise)',
    exit_code    Int64                  COMMENT 'Exit status of the process that ended (negative: killed by that signal); 0 for ServiceStarted',
    restarts     UInt32                 COMMENT 'Restarts of the service so far (this one included)',
    reason       String                 COMMENT 'How the process ended and the last error line of its log',
    backoff_s    Float64                COMMENT 'Wait before the restart, seconds',
    event_id     String                 COMMENT 'Unique id of the event',
    ts           DateTime64(6)          COMMENT 'When the supervisor published it'
)
ENGINE = ReplacingMergeTree ORDER BY (run_id, ts, event_id);
