-- Per-row delivery state for the recovery/poll path: how often a row failed, why, when to try
-- again, and when it became a dead letter. Additive and defaulted, so the Go kit's table (and
-- its own poller, which reads only its columns) accepts it unchanged.
-- +goose Up
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0;
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS last_error text;
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz;
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS dead_at timestamptz;
CREATE OR REPLACE VIEW outbox_dead_letters AS
    SELECT id, event_id, event_name, attempts, last_error, created_at, dead_at
    FROM outbox_events
    WHERE dead_at IS NOT NULL AND published_at IS NULL;

-- +goose Down
DROP VIEW IF EXISTS outbox_dead_letters;
ALTER TABLE outbox_events DROP COLUMN IF EXISTS dead_at;
ALTER TABLE outbox_events DROP COLUMN IF EXISTS next_attempt_at;
ALTER TABLE outbox_events DROP COLUMN IF EXISTS last_error;
ALTER TABLE outbox_events DROP COLUMN IF EXISTS attempts;
