-- The publication outbox-relay streams: the outbox table, inserts only (updates such as
-- published_at marking, deletes from cleanup and truncates are never decoded into tasks).
-- publish_via_partition_root: on a partitioned outbox, changes are published as the table's own
-- (pgoutput names the table, not its partitions); no effect on a plain table.
-- Idempotent: an existing publication of that name is left alone.
-- +goose Up
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_relay') THEN
        CREATE PUBLICATION outbox_relay FOR TABLE outbox_events WITH (publish = 'insert', publish_via_partition_root = true);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP PUBLICATION IF EXISTS outbox_relay;
