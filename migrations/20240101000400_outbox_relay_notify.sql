-- Wakes poll-mode relays at once when rows are inserted (LISTEN outbox_relay), instead of at
-- their next poll interval. One notification per INSERT statement, not per row, and Postgres
-- folds identical notifications of one transaction into one, so the cost stays small.
-- Harmless without listeners; remove it with the Down section if you never run poll mode.
-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_relay_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', '');
    RETURN NULL;
END
$$;
-- +goose StatementEnd
DROP TRIGGER IF EXISTS outbox_relay_notify ON outbox_events;
CREATE TRIGGER outbox_relay_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_relay_notify();

-- +goose Down
DROP TRIGGER IF EXISTS outbox_relay_notify ON outbox_events;
DROP FUNCTION IF EXISTS outbox_relay_notify();
