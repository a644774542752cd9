-- Batched Kafka records (kafka.samples_per_record): one record may carry several events, each
-- recorded as its own row; `record_index` is which event of its record the row is, and joins the
-- sorting key so that the rows of one record are not collapsed by ReplacingMergeTree. Idempotent:
-- apply_ddl re-runs it on each open; rows stored before 008 read 0 (one event per record).

ALTER TABLE events ADD COLUMN IF NOT EXISTS record_index UInt32 COMMENT 'Which event of its Kafka record this is (0 for a record of one event)', MODIFY ORDER BY (topic, partition, offset, record_index);
ALTER TABLE dlq ADD COLUMN IF NOT EXISTS record_index UInt32 COMMENT 'Which event of its Kafka record the dead letter is about (DeadLetter.index)', MODIFY ORDER BY (run_id, source_topic, partition, offset, service, record_index);
