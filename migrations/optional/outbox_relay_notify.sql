-- OPTIONAL, for poll mode only (`outbox-relay migrate --with-notify-trigger` applies it; goose
-- does not, as it lives outside migrations/). Wakes poll-mode relays at once when rows are
-- inserted (LISTEN outbox_relay) instead of at their next poll interval. One notification per
-- INSERT statement, and Postgres folds identical notifications of one transaction into one.
-- The cost: Postgres serialises the commits of transactions that sent a notification (they
-- take a global lock on the notification queue), which limits producers at high commit
-- rates. Stream mode does not need it.
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
