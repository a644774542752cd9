-- Dead letters name their group too (DeadLetter.group_id): a dead-lettered sample's group completes
-- without it. Idempotent: apply_ddl re-runs it on each open; rows stored before 004 read ''.
ALTER TABLE dlq ADD COLUMN IF NOT EXISTS group_id String DEFAULT '' COMMENT 'Group of the sample the message was about, when known (else empty)';
