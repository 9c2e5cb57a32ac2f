//! `outbox-relay status`: the slot, the publication, the backlog in the table, dead letters
//! and the pending tasks per Valkey queue, as a compact table or JSON. Never prints secrets.

use crate::command::{self, CommandError};
use crate::config::StatusArgs;
use crate::pgoutput::TableName;
use crate::sink::valkey::{pending_key, QUEUES_KEY};
use crate::store::Store;
use serde::Serialize;
use std::fmt::Write;

#[derive(Debug, Serialize)]
pub struct Status {
    pub slot: SlotStatus,
    pub publication: PublicationStatus,
    pub table: TableStatus,
    /// `None` when the table does not exist.
    pub unpublished_rows: Option<i64>,
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// `None` when the table does not exist.
    pub dead_letters: Option<i64>,
    /// `None` when Valkey could not be reached.
    pub queues: Option<Vec<QueueStatus>>,
}

#[derive(Debug, Serialize)]
pub struct SlotStatus {
    pub name: String,
    pub exists: bool,
    pub active: bool,
    pub wal_status: Option<String>,
    pub confirmed_flush_lsn: Option<String>,
    pub lag_bytes: Option<i64>,
}

#[derive(Debug, Serialize)]
pub struct PublicationStatus {
    pub name: String,
    pub exists: bool,
    /// Its oid: a different one than before means it was dropped and created again (by someone,
    /// or by the relay, counted in `outbox_publication_restored_total`). Before PostgreSQL 18 a
    /// slot older than that cannot decode past the drop, and the relay recreates the slot
    /// (`outbox_publication_recreated_total`); from 18 the slot is kept.
    pub oid: Option<u32>,
    pub tables: Vec<String>,
    pub operations: Vec<String>,
}

/// The outbox table (OUTBOX_TABLE): a typo in its name is reported here, with the tables of
/// similar name, rather than failing the whole command.
#[derive(Debug, Serialize)]
pub struct TableStatus {
    pub name: String,
    pub exists: bool,
    /// When it does not exist: tables whose names are close to it.
    pub similar: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct QueueStatus {
    pub queue: String,
    pub pending: i64,
}

/// Reads everything; Valkey being unreachable is reported, not an error.
pub async fn collect(
    client: &tokio_postgres::Client,
    valkey: Option<crate::valkey::ValkeyConnection>,
    table: &TableName,
    publication: &str,
    slot: &str,
) -> Result<Status, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT active, wal_status, confirmed_flush_lsn::text, \
                    (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let slot = SlotStatus {
        name: slot.to_owned(),
        exists: row.is_some(),
        active: row.as_ref().is_some_and(|r| r.get(0)),
        wal_status: row.as_ref().and_then(|r| r.get(1)),
        confirmed_flush_lsn: row.as_ref().and_then(|r| r.get(2)),
        lag_bytes: row.as_ref().and_then(|r| r.get(3)),
    };
    let publication = publication_status(client, publication).await?;
    let exists: Option<u32> = client
        .query_one("SELECT to_regclass($1)::oid", &[&table.sql()])
        .await?
        .get(0);
    let (table_status, unpublished_rows, oldest, dead_letters) = if exists.is_some() {
        let store = Store::new(table.clone());
        let (unpublished, oldest) = store.unpublished(client).await?;
        let dead = store.dead_letters_count(client).await?;
        let t = TableStatus {
            name: table.sql(),
            exists: true,
            similar: Vec::new(),
        };
        (t, Some(unpublished), oldest, Some(dead))
    } else {
        let t = TableStatus {
            name: table.sql(),
            exists: false,
            similar: crate::replication::setup::similar_tables(client, table).await?,
        };
        (t, None, None, None)
    };
    let queues = match valkey {
        Some(mut conn) => queue_status(&mut conn).await.ok(),
        None => None,
    };
    Ok(Status {
        slot,
        publication,
        table: table_status,
        unpublished_rows,
        oldest_unpublished_age_seconds: oldest,
        dead_letters,
        queues,
    })
}

async fn publication_status(
    client: &tokio_postgres::Client,
    name: &str,
) -> Result<PublicationStatus, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate, oid FROM pg_publication WHERE pubname = $1",
            &[&name],
        )
        .await?;
    let tables = client
        .query(
            "SELECT format('%s.%s', schemaname, tablename) FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[&name],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let operations = row
        .as_ref()
        .map(|r| {
            ["insert", "update", "delete", "truncate"]
                .iter()
                .enumerate()
                .filter(|(i, _)| r.get::<_, bool>(*i))
                .map(|(_, op)| (*op).to_owned())
                .collect()
        })
        .unwrap_or_default();
    Ok(PublicationStatus {
        name: name.to_owned(),
        exists: row.is_some(),
        oid: row.as_ref().map(|r| r.get(4)),
        tables,
        operations,
    })
}

/// The queues of `asynq:queues` and their pending lengths (on a cluster each `LLEN` goes to the
/// shard of its queue).
async fn queue_status(
    conn: &mut crate::valkey::ValkeyConnection,
) -> redis::RedisResult<Vec<QueueStatus>> {
    let mut queues: Vec<String> = redis::cmd("SMEMBERS")
        .arg(QUEUES_KEY)
        .query_async(conn)
        .await?;
    queues.sort();
    let mut out = Vec::with_capacity(queues.len());
    for queue in queues {
        let pending: i64 = redis::cmd("LLEN")
            .arg(pending_key(&queue))
            .query_async(conn)
            .await?;
        out.push(QueueStatus { queue, pending });
    }
    Ok(out)
}

/// A compact human table.
pub fn render(s: &Status) -> String {
    let mut out = String::new();
    let yes = |b: bool| if b { "yes" } else { "no" };
    let _ = writeln!(
        out,
        "slot         {:<24} exists={} active={} wal_status={} confirmed={} lag={}",
        s.slot.name,
        yes(s.slot.exists),
        yes(s.slot.active),
        s.slot.wal_status.as_deref().unwrap_or("-"),
        s.slot.confirmed_flush_lsn.as_deref().unwrap_or("-"),
        s.slot
            .lag_bytes
            .map_or("-".into(), |b| format!("{b} bytes")),
    );
    let _ = writeln!(
        out,
        "publication  {:<24} exists={} oid={} tables={} publishes={}",
        s.publication.name,
        yes(s.publication.exists),
        s.publication.oid.map_or("-".into(), |o| o.to_string()),
        if s.publication.tables.is_empty() {
            "-".into()
        } else {
            s.publication.tables.join(",")
        },
        if s.publication.operations.is_empty() {
            "-".into()
        } else {
            s.publication.operations.join(",")
        },
    );
    if s.table.exists {
        let _ = writeln!(
            out,
            "outbox       unpublished={} oldest={} dead_letters={}",
            s.unpublished_rows.unwrap_or_default(),
            s.oldest_unpublished_age_seconds
                .map_or("-".into(), |a| format!("{a:.1}s")),
            s.dead_letters.unwrap_or_default()
        );
    } else {
        let _ = writeln!(
            out,
            "outbox       {} does not exist (check OUTBOX_TABLE); similar={}",
            s.table.name,
            if s.table.similar.is_empty() {
                "-".into()
            } else {
                s.table.similar.join(",")
            },
        );
    }
    match &s.queues {
        None => {
            let _ = writeln!(out, "valkey       unreachable");
        }
        Some(qs) if qs.is_empty() => {
            let _ = writeln!(out, "valkey       no asynq queues yet");
        }
        Some(qs) => {
            for q in qs {
                let _ = writeln!(out, "queue        {:<24} pending={}", q.queue, q.pending);
            }
        }
    }
    out
}

/// `outbox-relay status`: collects and prints; Valkey being unreachable is reported, not an
/// error.
pub async fn execute(args: &StatusArgs) -> Result<(), CommandError> {
    let client = args.db.target()?.connect().await?;
    let valkey = match args.valkey.target()?.connect().await {
        Ok(conn) => Some(conn),
        Err(e) => {
            tracing::warn!(error = %e, valkey = %args.valkey.display(), "valkey unreachable");
            None
        }
    };
    let status = collect(
        &client,
        valkey,
        &args.db.table,
        &args.db.publication,
        &args.slot,
    )
    .await?;
    command::print(args.json, &status, render)
}
