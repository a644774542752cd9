-- Every event of every topic of a run, as recorded from Kafka.
-- Ingestion is idempotent on (topic, partition, offset): the recorder skips offsets it has
-- already stored, and ReplacingMergeTree collapses any duplicate that slips through a crash.
CREATE TABLE IF NOT EXISTS events
(
    topic          LowCardinality(String) COMMENT 'Kafka topic, rs.<run_id>.<name>',
    partition      UInt32                 COMMENT 'Kafka partition',
    offset         UInt64                 COMMENT 'Kafka offset within the partition',
    run_id         LowCardinality(String) COMMENT 'Run the event belongs to',
    name           LowCardinality(String) COMMENT 'Logical topic name (tasks, generations, ...)',
    kind           LowCardinality(String) COMMENT 'Event type (the msgspec tag, e.g. Generation)',
    key            String                 COMMENT 'Kafka message key, decoded as UTF-8',
    event_id       String                 COMMENT 'Unique event id',
    ts             DateTime64(6)          COMMENT 'Event creation time (event.ts)',
    policy_version Int64                  COMMENT 'Policy version the event refers to, -1 if none',
    payload        String                 COMMENT 'The event as JSON (msgspec; bytes as base64)',
    ingested_at    DateTime64(6) DEFAULT now64(6) COMMENT 'When the recorder stored it'
)
ENGINE = ReplacingMergeTree
ORDER BY (topic, partition, offset);
