-- The outbox table exactly as the Go kit (github.com/gp-system/events/outbox) creates it.
-- Idempotent: on a database where the kit's migration already ran, it changes nothing.
-- +goose Up
CREATE TABLE IF NOT EXISTS outbox_events (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id     uuid        NOT NULL UNIQUE,
    event_name   text        NOT NULL,
    payload      jsonb       NOT NULL,
    metadata     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_events_unpublished_idx ON outbox_events (id) WHERE published_at IS NULL;

-- +goose Down
-- Deliberately empty: dropping the outbox would lose undelivered events.
