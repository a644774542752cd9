-- Idempotent inserts: the recorder gives each insert a deduplication token derived from the Kafka
-- offsets of its batch (store/outage.py, batch_token), and retries a batch whose insert failed
-- with the same tokens. A table remembers the tokens of its last 1000 inserts and drops a block
-- whose token it has seen, so a batch stored in part before a failure (its typed tables written,
-- `events` not) is not stored twice when retried. Idempotent, but each run rewrites the tables'
-- metadata (0.2 s): apply_ddl applies it until its version is recorded, not at every open.
-- apply once
ALTER TABLE events MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE sample_tasks MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE sample_generations MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE sample_rewards MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE sample_outcomes MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE train_steps MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE evals MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE weights MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE dlq MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE env_events MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE recorder_lag MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE service_events MODIFY SETTING non_replicated_deduplication_window = 1000;
