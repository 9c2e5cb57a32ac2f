//! Start-up checks and the objects the stream needs: wal_level, the REPLICATION privilege, the
//! outbox table, the publication (created before the slot, inserts only) and the slot.
//! Every failure says what to do about it.

use crate::pgoutput::{OutboxColumn, TableName};
use pgwire_replication::Lsn;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(
        "wal_level is '{0}', but logical replication needs 'logical': run \
         `ALTER SYSTEM SET wal_level = logical;` and restart PostgreSQL \
         (on managed services set the parameter group / flag `wal_level=logical` or \
         `rds.logical_replication=1`), or run with OUTBOX_MODE=poll"
    )]
    WalLevel(String),
    #[error(
        "role {0:?} may not use replication: run `ALTER ROLE {0} REPLICATION;` as a superuser \
         (see docs/configuration.md for a least-privilege role)"
    )]
    NoReplicationPrivilege(String),
    #[error(
        "the outbox table {table} does not exist ({similar}): check OUTBOX_TABLE; only if the \
         name is right and the table was never created, run `outbox-relay migrate` (or the Go \
         kit's migration), which creates it"
    )]
    NoTable {
        table: String,
        similar: SimilarTables,
    },
    #[error(
        "the outbox table {table} lacks column(s) {missing}: it must have the Go kit's columns \
         (id, event_id, event_name, payload, metadata, created_at, published_at)"
    )]
    MissingColumns { table: String, missing: String },
    #[error(
        "the outbox table {table}'s column {column} is {found}, not {expected}: {why}; the Go \
         kit's table has `{column} {expected}` (`ALTER TABLE {table} ALTER COLUMN {column} TYPE \
         {expected} USING {column}::{expected};`)"
    )]
    ColumnType {
        table: String,
        column: &'static str,
        found: String,
        expected: &'static str,
        why: &'static str,
    },
    #[error(
        "the outbox table {table}: id has no unique index of its own and is not an identity \
         or sequence column; the poller claims and the marker marks rows by id, so rows sharing \
         an id would be marked published together, one of them never delivered; run \
         `CREATE UNIQUE INDEX CONCURRENTLY ON {table} (id);` (or make id an identity column: \
         the Go kit's table has `id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY`)"
    )]
    IdNotUnique { table: String },
    #[error(
        "the outbox table {table} is partitioned by {key}, and the relay updates {column}: \
         marking a row would move it to another partition, which logical decoding sends as a \
         new insert, so its event would be delivered again (run again once asynq's retention \
         has passed); partition the outbox by a column the relay never updates, such as \
         created_at or id"
    )]
    PartitionedByDeliveryState {
        table: String,
        key: String,
        column: &'static str,
    },
    #[error(
        "the outbox table {0} lacks the delivery-state columns (attempts, last_error, \
         next_attempt_at, dead_at) the poller needs: run `outbox-relay migrate` (additive; the Go \
         kit's relay keeps working)"
    )]
    NoDeliveryColumns(String),
    #[error(
        "publication {publication:?} exists but does not include {table}: run \
         `ALTER PUBLICATION {publication} ADD TABLE {table};` or choose another OUTBOX_PUBLICATION"
    )]
    PublicationLacksTable { publication: String, table: String },
    #[error(
        "publication {publication:?} publishes the partitions of {table}, not {table} itself: \
         pgoutput would name each partition, and the relay streams only {table}; run \
         `ALTER PUBLICATION {publication} SET (publish_via_partition_root = true);`"
    )]
    PublicationNotViaRoot { publication: String, table: String },
    #[error(
        "publication {publication:?} is missing while slot {slot:?} exists, and \
         OUTBOX_ON_SLOT_LOST=stop: the relay does not create it again, because from PostgreSQL 18 \
         the slot would skip the events committed while it was missing (before 18 it cannot \
         decode past the drop). Those events are in the table, unpublished. {first}{deliver}",
        first = crate::replication::stream::PUBLICATION_FIRST,
        deliver = crate::replication::stream::DELIVER_LEFT_ROWS
    )]
    PublicationDroppedBehindSlot { publication: String, slot: String },
    #[error(
        "publication {publication:?} publishes only some columns of {table}, without {missing}: \
         tasks would be built without them; run `ALTER PUBLICATION {publication} SET TABLE \
         {table};` (all columns)"
    )]
    PublicationColumnList {
        publication: String,
        table: String,
        missing: String,
    },
    #[error(
        "publication {publication:?} filters the rows of {table} (WHERE {filter}): the rows it \
         leaves out would come only from the recovery poller; run `ALTER PUBLICATION \
         {publication} SET TABLE {table};` (no filter)"
    )]
    PublicationRowFilter {
        publication: String,
        table: String,
        filter: String,
    },
    #[error(
        "publication {publication:?} does not publish inserts: run \
         `ALTER PUBLICATION {publication} SET (publish = 'insert');`"
    )]
    PublicationWithoutInserts { publication: String },
    #[error(
        "slot {slot:?} uses plugin {plugin:?}, not pgoutput: drop it \
         (`SELECT pg_drop_replication_slot('{slot}');`) or choose another OUTBOX_SLOT"
    )]
    WrongPlugin { slot: String, plugin: String },
    #[error(
        "slot {slot:?} belongs to database {database:?}, not this one: choose another OUTBOX_SLOT"
    )]
    WrongDatabase { slot: String, database: String },
    #[error("slot {0:?} is a physical slot: choose another OUTBOX_SLOT")]
    PhysicalSlot(String),
    #[error("slot {0:?} was dropped right after it was created (another process?)")]
    SlotVanished(String),
    #[error("postgres query failed during setup")]
    Query(#[from] tokio_postgres::Error),
}

/// Refuses a server that cannot stream logical changes.
pub async fn check_wal_level(client: &Client) -> Result<(), SetupError> {
    let row = client.query_one("SHOW wal_level", &[]).await?;
    let level: String = row.get(0);
    if level != "logical" {
        return Err(SetupError::WalLevel(level));
    }
    Ok(())
}

/// Refuses a role that can neither replicate nor is superuser.
pub async fn check_replication_privilege(client: &Client) -> Result<(), SetupError> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let (user, ok): (String, bool) = (row.get(0), row.get(1));
    if !ok {
        return Err(SetupError::NoReplicationPrivilege(user));
    }
    Ok(())
}

/// The table as `schema.table`, resolved through the search path as SQL resolves it. The stream
/// then takes rows only from that table: a table of the same name in another schema of the
/// publication is not the outbox, and its ids must never mark the outbox's rows.
pub async fn resolve_table(client: &Client, table: &TableName) -> Result<TableName, SetupError> {
    if table.schema.is_some() {
        return Ok(table.clone());
    }
    let row = client
        .query_opt(
            "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = to_regclass($1)",
            &[&table.sql()],
        )
        .await?;
    let Some(row) = row else {
        return Err(no_table(client, table).await);
    };
    let schema: String = row.get(0);
    Ok(TableName::parse(&format!("{schema}.{}", table.table)).unwrap_or_else(|| table.clone()))
}

/// Tables whose names are close to a missing table's, for its error message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimilarTables(pub Vec<String>);

impl std::fmt::Display for SimilarTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("no table of similar name")
        } else {
            write!(f, "tables of similar name: {}", self.0.join(", "))
        }
    }
}

/// The error for a missing `table`, listing the tables of similar name (none when they cannot
/// be read).
pub async fn no_table(client: &Client, table: &TableName) -> SetupError {
    let similar = similar_tables(client, table).await.unwrap_or_else(|e| {
        tracing::debug!(error = %e, "could not list tables of similar name");
        Vec::new()
    });
    SetupError::NoTable {
        table: table.sql(),
        similar: SimilarTables(similar),
    }
}

/// Tables (outside the system schemas) whose name is close to `table`'s: at most five, the
/// closest first.
pub async fn similar_tables(
    client: &Client,
    table: &TableName,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT tablename::text, format('%I.%I', schemaname, tablename) FROM pg_tables \
             WHERE schemaname NOT IN ('pg_catalog', 'information_schema') \
             ORDER BY 2 LIMIT 10000",
            &[],
        )
        .await?;
    let candidates: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    Ok(closest_names(&table.table, &candidates))
}

/// Of `candidates` (bare name, qualified name), the qualified names of those close to `wanted`:
/// a few edits away (about a third of its length, at least 2), or one containing the other.
fn closest_names(wanted: &str, candidates: &[(String, String)]) -> Vec<String> {
    let wanted = wanted.to_lowercase();
    let limit = (wanted.chars().count() / 3).max(2);
    let mut close: Vec<(usize, &String)> = candidates
        .iter()
        .filter_map(|(name, qualified)| {
            let name = name.to_lowercase();
            let d = edit_distance(&wanted, &name);
            let contains = name.len() >= 3 && (name.contains(&wanted) || wanted.contains(&name));
            (d <= limit || contains).then_some((d, qualified))
        })
        .collect();
    close.sort();
    close.into_iter().take(5).map(|(_, q)| q.clone()).collect()
}

/// Levenshtein distance, over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = Vec::with_capacity(b.len() + 1);
        cur.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Columns whose type the relay relies on: the types accepted (the Go kit's first), and why.
const COLUMN_TYPES: &[(&str, &[&str], &str)] = &[
    (
        "id",
        &["bigint"],
        // The stream reads `id` as text and parses it as an i64; an integer, uuid or text id
        // (a uuid id is a bad row to the stream too) fails every row of the poller and the
        // marker, so rows only the poller can deliver never would be.
        "the poller and the marker claim and mark rows by a 64-bit id",
    ),
    (
        "event_id",
        &["uuid"],
        "the marker matches delivered rows by (id, event_id) as uuids, so with another type \
         every mark would fail and the recovery poller would send every row again",
    ),
    (
        "created_at",
        &["timestamp with time zone"],
        "the Envelope's occurred_at needs the time's offset, so every row of a timestamp \
         without a zone would be a bad row (a dead letter)",
    ),
    (
        "payload",
        &["jsonb", "json"],
        "the Envelope carries the payload as JSON, and text that is not JSON would make tasks \
         the consumers cannot decode",
    ),
];

/// Checks the table exists and has the columns a task is built from.
///
/// `payload_is_json`: the payload goes into the Envelope as JSON
/// (`OUTBOX_PAYLOAD_FORMAT=envelope`), so it must be `jsonb` or `json`; with `raw` (and for the
/// operator commands) any type is left.
pub async fn check_table(
    client: &Client,
    table: &TableName,
    payload_is_json: bool,
) -> Result<(), SetupError> {
    let row = client
        .query_one("SELECT to_regclass($1)::oid", &[&table.sql()])
        .await?;
    let oid: Option<u32> = row.get(0);
    let Some(oid) = oid else {
        return Err(no_table(client, table).await);
    };
    let rows = client
        .query(
            // A domain counts as its base type, through domains over domains (a domain over
            // bigint reads as a bigint).
            "WITH RECURSIVE base(attname, typ, depth) AS ( \
                 SELECT a.attname::text, a.atttypid, 0 FROM pg_attribute a \
                 WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped \
               UNION ALL \
                 SELECT b.attname, t.typbasetype, b.depth + 1 FROM base b \
                 JOIN pg_type t ON t.oid = b.typ WHERE t.typbasetype <> 0) \
             SELECT DISTINCT ON (attname) attname, format_type(typ, NULL) FROM base \
             ORDER BY attname, depth DESC",
            &[&oid],
        )
        .await?;
    let have: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    // `id` is optional to the task builder, but the poller claims rows by it and the marker
    // marks them by it: without it, rows left to the poller (bad rows, refused queues, rows a
    // lost slot skipped) would never be delivered.
    let missing: Vec<&str> = OutboxColumn::ALL
        .into_iter()
        .filter(|c| {
            (c.required() || *c == OutboxColumn::Id) && !have.iter().any(|(h, _)| h == c.name())
        })
        .map(OutboxColumn::name)
        .collect();
    if !missing.is_empty() {
        return Err(SetupError::MissingColumns {
            table: table.sql(),
            missing: missing.join(", "),
        });
    }
    // The columns whose type the relay relies on, refused before anything is acknowledged
    // (found by review: id first, then the others, each of which failed every row without a
    // word at start). Domains count as their base type.
    for &(column, accepted, why) in COLUMN_TYPES {
        if column == "payload" && !payload_is_json {
            continue;
        }
        if let Some((_, found)) = have.iter().find(|(name, _)| name == column) {
            if !accepted.contains(&found.as_str()) {
                return Err(SetupError::ColumnType {
                    table: table.sql(),
                    column,
                    found: found.clone(),
                    expected: accepted[0],
                    why,
                });
            }
        }
    }
    // Rows sharing an id: the marker's `WHERE id = ANY(...)` marks all of them when one is
    // delivered, so one whose queue refused it, or that a lost slot skipped, would be marked
    // published and never delivered; and the poller's per-row attempt fails on every round
    // (found by review: the poller stopped). Unique: a valid unique index on id alone, or ids
    // from an identity or a sequence (a partitioned table's unique keys must include its
    // partition key, so only the latter there).
    let unique: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = a.attrelid \
                 AND i.indisunique AND i.indisvalid AND i.indnkeyatts = 1 \
                 AND i.indpred IS NULL AND i.indkey[0] = a.attnum) \
             OR a.attidentity <> '' \
             OR EXISTS (SELECT 1 FROM pg_attrdef d WHERE d.adrelid = a.attrelid \
                 AND d.adnum = a.attnum AND pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval(%') \
             FROM pg_attribute a WHERE a.attrelid = $1 AND a.attname = 'id'",
            &[&oid],
        )
        .await?
        .get(0);
    if !unique {
        return Err(SetupError::IdNotUnique { table: table.sql() });
    }
    // A partition key the relay changes: an UPDATE that moves a row to another partition is
    // decoded as a delete and an insert, and the insert is streamed as a new event (found by
    // review: 300 events, 300 sent again; with retention 0, 583 runs). Every partitioned level
    // counts (sub-partitions have keys of their own).
    let keys = client
        .query(
            "SELECT pg_get_partkeydef(t.relid) FROM pg_partition_tree($1::oid::regclass) t \
             JOIN pg_class c ON c.oid = t.relid WHERE c.relkind = 'p'",
            &[&oid],
        )
        .await?;
    for key in keys.iter().filter_map(|r| r.get::<_, Option<String>>(0)) {
        if let Some(column) = updated_column_in(&key) {
            return Err(SetupError::PartitionedByDeliveryState {
                table: table.sql(),
                key,
                column,
            });
        }
    }
    Ok(())
}

/// The columns the relay updates on a row (marking, attempts, dead letters).
const UPDATED_COLUMNS: [&str; 5] = [
    "published_at",
    "attempts",
    "last_error",
    "next_attempt_at",
    "dead_at",
];

/// The first column of [`UPDATED_COLUMNS`] a partition key definition
/// (`pg_get_partkeydef`, e.g. `RANGE (published_at)` or `LIST (coalesce(dead_at, ...))`)
/// names, as a whole word (a quoted name reads the same once the quotes are dropped).
fn updated_column_in(key: &str) -> Option<&'static str> {
    let words: Vec<&str> = key
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    UPDATED_COLUMNS
        .into_iter()
        .find(|c| words.iter().any(|w| w.eq_ignore_ascii_case(c)))
}

/// Creates the publication (inserts only) when missing; checks an existing one covers the table.
/// Returns whether this call created it.
pub async fn ensure_publication(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<bool, SetupError> {
    let others = match check_publication(client, publication, table).await? {
        Some(others) => others,
        None => return create_publication(client, publication, table).await,
    };
    if others {
        tracing::warn!(
            publication,
            "publication also publishes updates, deletes or truncates: they are ignored, \
             but cost decoding; `ALTER PUBLICATION ... SET (publish = 'insert')` avoids that \
             (a running relay with OUTBOX_ON_SLOT_LOST=stop stops at any ALTER of its \
             publication: run it while the relay is stopped)"
        );
    }
    Ok(false)
}

/// As [`ensure_publication`], without the start-up warnings: for a check that runs again and
/// again while the relay runs.
pub async fn restore_publication(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<bool, SetupError> {
    match check_publication(client, publication, table).await? {
        Some(_) => Ok(false),
        None => create_publication(client, publication, table).await,
    }
}

/// How long creating the publication may take before the server ends it (and it is tried again
/// at the next check or start): in practice, how long it waits for the table's lock.
pub const PUBLICATION_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Creates the publication, inserts of `table` only; `false` when another session created it
/// first (another relay), after checking the one it created.
async fn create_publication(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<bool, SetupError> {
    // CREATE PUBLICATION ... FOR TABLE takes a SHARE UPDATE EXCLUSIVE lock on the table, which
    // a VACUUM, an ANALYZE or CREATE INDEX CONCURRENTLY holds for long: without a bound each
    // periodic check left one more session waiting behind it (found by review: 10 in 30 s).
    // The bound is on the statement, not on one lock wait: a second creator waits first for
    // the first one's transaction (the publication's name), then for the table, each wait up
    // to a lock_timeout (found by tests/publication.rs: five sessions waited at once under a
    // 5 s lock_timeout). The connections this runs on are the relay's own, made for the check,
    // the repair or the start-up; the watch waits for the server's answer (see
    // `publication::watch`), so checks do not overlap. SET LOCAL, in a transaction of its
    // own: nothing outlives it, whether through a transaction pooler or a future dropped
    // halfway (found by review).
    // Names are validated identifiers (config), so formatting them in is safe.
    let created = client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL statement_timeout = {}; \
             CREATE PUBLICATION {publication} FOR TABLE {} \
             WITH (publish = 'insert', publish_via_partition_root = true); COMMIT",
            PUBLICATION_LOCK_WAIT.as_millis(),
            table.sql()
        ))
        .await;
    if created.is_err() {
        // The statements after the failed one did not run: end the failed transaction. The
        // error worth reporting is the CREATE's; a ROLLBACK that fails too means a lost
        // connection, which the next statement on it reports.
        if let Err(e) = client.batch_execute("ROLLBACK").await {
            tracing::debug!(error = %e, "ROLLBACK after a failed CREATE PUBLICATION");
        }
    }
    match created {
        Ok(()) => {
            tracing::info!(publication, table = %table, "created publication (inserts only)");
            Ok(true)
        }
        // "already exists", or the unique index on its name when both looked first.
        Err(e)
            if e.code() == Some(&SqlState::DUPLICATE_OBJECT)
                || e.code() == Some(&SqlState::UNIQUE_VIOLATION) =>
        {
            check_publication(client, publication, table).await?;
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// The publication as the current catalog has it: `None` when it does not exist; else whether it
/// also publishes updates, deletes or truncates. An existing publication that does not publish
/// the table's inserts is the error that says how to fix it.
pub async fn check_publication(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<Option<bool>, SetupError> {
    let row = client
        .query_opt(
            "SELECT pubinsert, pubupdate OR pubdelete OR pubtruncate FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let (inserts, others): (bool, bool) = (row.get(0), row.get(1));
    if !inserts {
        return Err(SetupError::PublicationWithoutInserts {
            publication: publication.to_owned(),
        });
    }
    // A partitioned outbox: without publish_via_partition_root, pgoutput names each leaf
    // partition, which the stream takes for another table, and pg_publication_tables lists
    // the leaves (found by review: only the recovery poller delivered, and the next start
    // refused the publication with advice PostgreSQL rejects).
    let not_via_root = client
        .query_opt(
            "SELECT c.relkind = 'p' AND NOT p.pubviaroot FROM pg_publication p, pg_class c \
             WHERE p.pubname = $1 AND c.oid = to_regclass($2)",
            &[&publication, &table.sql()],
        )
        .await?;
    if not_via_root.is_some_and(|r| r.get::<_, bool>(0)) {
        return Err(SetupError::PublicationNotViaRoot {
            publication: publication.to_owned(),
            table: table.sql(),
        });
    }
    // Matched by name, not by casting each row to regclass: the planner may evaluate
    // such a cast on every relation of pg_class, including those of pg_toast, where a
    // role without superuser has no USAGE ("permission denied for schema pg_toast").
    let covered = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables t \
             JOIN pg_namespace n ON n.nspname = t.schemaname \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename \
             WHERE t.pubname = $1 AND c.oid = to_regclass($2))",
            &[&publication, &table.sql()],
        )
        .await?;
    if !covered.get::<_, bool>(0) {
        return Err(SetupError::PublicationLacksTable {
            publication: publication.to_owned(),
            table: table.sql(),
        });
    }
    check_publication_filters(client, publication, table).await?;
    Ok(Some(others))
}

/// `server_version_num`, e.g. 150004.
async fn server_version_num(client: &Client) -> Result<i32, SetupError> {
    Ok(client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await?
        .get(0))
}

/// The publication's identity and the table's membership of it (see
/// [`super::publication::PublicationIdentity`]); `None` when it does not exist.
pub async fn publication_identity(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<Option<super::publication::PublicationIdentity>, SetupError> {
    let version = server_version_num(client).await?;
    // A table is in a publication by a pg_publication_rel row, or from 15 by its schema's
    // pg_publication_namespace row (FOR TABLES IN SCHEMA); FOR ALL TABLES has neither.
    let schema_member = if version >= 150_000 {
        "(SELECT n.oid FROM pg_publication_namespace n JOIN pg_class c \
           ON c.relnamespace = n.pnnspid \
         WHERE n.pnpubid = p.oid AND c.oid = to_regclass($2)::oid)"
    } else {
        "NULL::oid"
    };
    let row = client
        .query_opt(
            &format!(
                "SELECT p.oid, p.xmin::text, coalesce( \
                   (SELECT r.oid FROM pg_publication_rel r \
                    WHERE r.prpubid = p.oid AND r.prrelid = to_regclass($2)::oid), \
                   {schema_member}) \
                 FROM pg_publication p WHERE p.pubname = $1"
            ),
            &[&publication, &table.sql()],
        )
        .await?;
    Ok(row.map(|r| super::publication::PublicationIdentity {
        oid: r.get(0),
        xmin: r.get(1),
        member: r.get(2),
    }))
}

/// From PostgreSQL 15 a publication may carry a column list or a row filter for the table; the
/// relay refuses both (found by review): a column list without `metadata` made tasks without
/// it and marked their rows published, and a row filter leaves the rows it filters to the
/// recovery poller only (to nobody with `OUTBOX_RECOVERY=false`).
async fn check_publication_filters(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<(), SetupError> {
    let version = server_version_num(client).await?;
    if version < 150_000 {
        return Ok(());
    }
    let row = client
        .query_opt(
            "SELECT t.attnames::text[], t.rowfilter FROM pg_publication_tables t \
             JOIN pg_namespace n ON n.nspname = t.schemaname \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename \
             WHERE t.pubname = $1 AND c.oid = to_regclass($2)",
            &[&publication, &table.sql()],
        )
        .await?;
    let Some(row) = row else { return Ok(()) };
    let (columns, filter): (Option<Vec<String>>, Option<String>) = (row.get(0), row.get(1));
    if let Some(filter) = filter {
        return Err(SetupError::PublicationRowFilter {
            publication: publication.to_owned(),
            table: table.sql(),
            filter,
        });
    }
    let columns = columns.unwrap_or_default();
    // The columns a task is built from: a column list that leaves one out streams rows without
    // it (the metadata, and with it the trace context, silently empty).
    let missing: Vec<&str> = crate::pgoutput::OutboxColumn::ALL
        .iter()
        .map(|c| c.name())
        .filter(|c| !columns.iter().any(|have| have == c))
        .collect();
    if !missing.is_empty() {
        return Err(SetupError::PublicationColumnList {
            publication: publication.to_owned(),
            table: table.sql(),
            missing: missing.join(", "),
        });
    }
    Ok(())
}

/// A slot as `pg_replication_slots` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub confirmed_flush: Lsn,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
}

/// Reads the slot, `None` when it does not exist. Refuses a slot the stream cannot use.
pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, SetupError> {
    let row = client
        .query_opt(
            "SELECT slot_type, coalesce(plugin, ''), coalesce(database::text, ''), current_database()::text, \
                    coalesce(confirmed_flush_lsn::text, '0/0'), wal_status \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let (kind, plugin, db, current_db): (String, String, String, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if kind != "logical" {
        return Err(SetupError::PhysicalSlot(slot.to_owned()));
    }
    if plugin != "pgoutput" {
        return Err(SetupError::WrongPlugin {
            slot: slot.to_owned(),
            plugin,
        });
    }
    if db != current_db {
        return Err(SetupError::WrongDatabase {
            slot: slot.to_owned(),
            database: db,
        });
    }
    let lsn: String = row.get(4);
    Ok(Some(SlotInfo {
        confirmed_flush: Lsn::parse(&lsn).unwrap_or(Lsn::ZERO),
        wal_status: row.get(5),
    }))
}

/// Drops the slot if it exists (it must not be in use).
pub async fn drop_slot(client: &Client, slot: &str) -> Result<(), SetupError> {
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(())
}

/// Checks the table has the delivery-state columns the poller needs (migration 3).
pub async fn check_poller_columns(client: &Client, table: &TableName) -> Result<(), SetupError> {
    let row = client
        .query_one(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1) AND NOT attisdropped \
             AND attname IN ('attempts', 'last_error', 'next_attempt_at', 'dead_at')",
            &[&table.sql()],
        )
        .await?;
    if row.get::<_, i64>(0) != 4 {
        return Err(SetupError::NoDeliveryColumns(table.sql()));
    }
    Ok(())
}

/// Whether a unique index covers event_id alone (the Go kit's `event_id uuid NOT NULL UNIQUE`).
/// Without one, two rows can share an event_id and become one task (crate::shared_event_ids).
/// An index left invalid (a `CREATE UNIQUE INDEX CONCURRENTLY` that failed, perhaps on the very
/// duplicates) enforces nothing and does not count.
pub async fn has_unique_event_id(client: &Client, table: &TableName) -> Result<bool, SetupError> {
    event_id_index(
        client,
        table,
        "i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL",
    )
    .await
}

/// Whether a usable index leads with event_id, so that looking rows up by event_id does not scan
/// the table.
pub async fn has_event_id_index(client: &Client, table: &TableName) -> Result<bool, SetupError> {
    event_id_index(client, table, "i.indpred IS NULL").await
}

async fn event_id_index(
    client: &Client,
    table: &TableName,
    condition: &str,
) -> Result<bool, SetupError> {
    let row = client
        .query_one(
            &format!(
                "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a \
                 ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
                 WHERE i.indrelid = to_regclass($1) AND i.indisvalid AND i.indisready \
                 AND i.indislive AND a.attname = 'event_id' AND {condition})"
            ),
            &[&table.sql()],
        )
        .await?;
    Ok(row.get(0))
}

/// Creates the slot when missing and returns it.
pub async fn ensure_slot(client: &Client, slot: &str) -> Result<SlotInfo, SetupError> {
    if let Some(info) = slot_info(client, slot).await? {
        return Ok(info);
    }
    // Two relays starting at once may race here: the loser's "already exists" is fine.
    // From PostgreSQL 17 a slot on a primary is a failover slot: a standby with
    // sync_replication_slots keeps a copy, and the stream goes on from it after a promotion
    // (docs/operations.md). A standby cannot create one.
    let failover: bool = client
        .query_one(
            "SELECT current_setting('server_version_num')::int >= 170000 AND NOT pg_is_in_recovery()",
            &[],
        )
        .await?
        .get(0);
    let create = if failover {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    let created = client.execute(create, &[&slot]).await;
    match created {
        Ok(_) => tracing::info!(
            slot,
            failover,
            "created logical replication slot (pgoutput)"
        ),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {}
        Err(e) => return Err(e.into()),
    }
    slot_info(client, slot)
        .await?
        .ok_or_else(|| SetupError::SlotVanished(slot.to_owned()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_partition_key_naming_an_updated_column_is_found() {
        assert_eq!(
            updated_column_in("RANGE (published_at)"),
            Some("published_at")
        );
        assert_eq!(
            updated_column_in("LIST (COALESCE(dead_at, '2000-01-01'::timestamp with time zone))"),
            Some("dead_at")
        );
        assert_eq!(updated_column_in("HASH (id, attempts)"), Some("attempts"));
        assert_eq!(updated_column_in("RANGE (created_at)"), None);
        assert_eq!(updated_column_in("HASH (id)"), None);
        assert_eq!(updated_column_in("RANGE (published_at_day)"), None);
    }

    use super::*;

    fn names(list: &[&str]) -> Vec<(String, String)> {
        list.iter()
            .map(|n| (n.to_string(), format!("public.{n}")))
            .collect()
    }

    #[test]
    fn a_typo_finds_the_real_table_and_unrelated_ones_are_left_out() {
        let tables = names(&[
            "outbox_events",
            "orders",
            "customers",
            "outbox_events_archive",
        ]);
        assert_eq!(
            closest_names("outbx_events", &tables),
            ["public.outbox_events"]
        );
        assert_eq!(
            closest_names("outbox_event", &tables),
            ["public.outbox_events", "public.outbox_events_archive"]
        );
        assert!(closest_names("payments", &tables).is_empty());
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(
            SimilarTables(vec!["public.outbox_events".into()]).to_string(),
            "tables of similar name: public.outbox_events"
        );
    }
}
