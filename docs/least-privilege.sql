-- A least-privilege PostgreSQL role for outbox-relay (see docs/configuration.md, "The
-- PostgreSQL role").
--
-- First run `outbox-relay migrate` as the owner of the outbox table: it adds the
-- delivery-state columns and creates the publication, and creating a publication needs
-- ownership of the table. The relay's role then owns nothing and creates nothing but its
-- replication slot (the REPLICATION attribute allows that).
--
-- Run this as a superuser (creating a role with REPLICATION needs one; on PostgreSQL 16 and
-- later, a role with CREATEROLE and REPLICATION will do) after replacing the role name, its
-- password, the database (`shop`) and, for a table outside `public` or another OUTBOX_TABLE,
-- the schema and table. The integration tests run this file as it is, with only the role, the
-- password and the database replaced, and run the relay as that role
-- (tests/common/mod.rs, TestDb::least_privilege_role).

-- Which command needs which grant (everything else the relay does needs only what is granted
-- below without a comment mark):
--
--   command / setting                           needs
--   run (stream or poll mode), status, trace,   LOGIN, REPLICATION (stream mode), CONNECT,
--     replay, reconcile,                        USAGE on the schema, SELECT and the column
--     dead-letters list, dead-letters retry     UPDATE below
--   run with OUTBOX_CLEANUP_OLDER_THAN set      + DELETE on the table (commented out below)
--   run with OUTBOX_DELETE_DELIVERED=true       + DELETE on the table (commented out below)
--   cleanup                                     + DELETE on the table (commented out below)
--   run, fast takeover between replicas         + pg_read_all_stats (below; optional)
--   migrate                                     not this role: the table's owner (it alters
--                                               the table and creates the publication)
--
-- Without DELETE, cleanup fails with "permission denied for table outbox_events".

-- LOGIN to connect; REPLICATION for the logical replication connection and for
-- pg_create_logical_replication_slot (the slot is created when missing).
CREATE ROLE outbox_relay LOGIN REPLICATION PASSWORD 'change-me';

-- PUBLIC has both by default; granted here so that revoking them from PUBLIC is safe.
GRANT CONNECT ON DATABASE shop TO outbox_relay;
GRANT USAGE ON SCHEMA public TO outbox_relay;

-- SELECT: the start-up checks, the recovery poller, `status`, `dead-letters list`.
-- UPDATE of these columns only: claiming rows (SELECT ... FOR UPDATE SKIP LOCKED needs UPDATE
-- on at least one column), marking them published, recording failed attempts and dead letters,
-- and `dead-letters retry`.
GRANT SELECT, UPDATE (published_at, attempts, last_error, next_attempt_at, dead_at)
    ON public.outbox_events TO outbox_relay;

-- DELETE: needed by the `cleanup` command, by `run` with OUTBOX_CLEANUP_OLDER_THAN (periodic
-- cleanup) and by `run` with OUTBOX_DELETE_DELIVERED=true (delivered rows are deleted instead of
-- marked). Uncomment it if you use any of them:
-- GRANT DELETE ON public.outbox_events TO outbox_relay;

-- pg_read_all_stats: lets a standby replica see pg_stat_replication.reply_time of the
-- walsender that holds the slot, so it can tell a live relay (its reply time changes every
-- second) from a zombie left by a cut connection, and take the slot over after
-- OUTBOX_TAKEOVER_AFTER. Without it the column reads NULL for this role: the replicas then never
-- terminate a walsender (a live one would look silent) and wait for the server's
-- wal_sender_timeout instead. It grants read access to statistics views only.
GRANT pg_read_all_stats TO outbox_relay;
