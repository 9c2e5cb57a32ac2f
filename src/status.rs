//! `outbox-relay status`: the server, the slot, the publication, the backlog in the table, dead
//! letters, the pending tasks per Valkey queue and what the running relay saw (its timeline,
//! slot changes and acknowledged position), as a compact table or JSON. Never prints secrets.

mod relay_view;

pub use relay_view::RelayView;

use crate::command::{self, CommandError};
use crate::config::StatusArgs;
use crate::pgoutput::TableName;
use crate::replication::slot_watch::TIMELINE_SQL;
use crate::sink::valkey::{pending_key, QUEUES_KEY};
use crate::store::Store;
use serde::Serialize;
use std::fmt::Write;

#[derive(Debug, Serialize)]
pub struct Status {
    pub server: ServerStatus,
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
    /// The running relay's view, from its `/metrics` at OUTBOX_METRICS_ADDR.
    pub relay: RelayView,
    /// What the slot, the server and the relay's view say together that an operator should
    /// know (a slot recreated behind the relay's back, a relay not yet on the new timeline).
    pub warnings: Vec<String>,
}

/// The Postgres server the SQL connection reached.
#[derive(Debug, Serialize)]
pub struct ServerStatus {
    /// `pg_control_system().system_identifier`: the same on a primary and its standbys; another
    /// one means another cluster (as a string: JSON numbers lose its low digits).
    pub system_identifier: String,
    /// The timeline it writes (a primary) or receives (a standby) WAL on; it goes up at each
    /// promotion.
    pub timeline: u32,
    /// `primary`, or `standby` (in recovery).
    pub role: &'static str,
    /// `server_version_num`, e.g. 170006.
    pub version: i32,
}

#[derive(Debug, Serialize)]
pub struct SlotStatus {
    pub name: String,
    pub exists: bool,
    pub active: bool,
    pub wal_status: Option<String>,
    pub confirmed_flush_lsn: Option<String>,
    pub lag_bytes: Option<i64>,
    /// PostgreSQL 17+: a failover slot, which standbys with `sync_replication_slots` keep a
    /// copy of (`None` before 17, or without the slot).
    pub failover: Option<bool>,
    /// PostgreSQL 17+: this copy was synced from a primary (true on a standby; on a promoted
    /// standby it may stay true, a leftover with no meaning there).
    pub synced: Option<bool>,
    /// PostgreSQL 17+: why the server invalidated the slot (`wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, 18's `idle_timeout`), `None` while it is valid.
    pub invalidation_reason: Option<String>,
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
/// The slot is read before the relay's view, so that the relay's acknowledgement is at least the
/// slot's position unless someone else moved the slot.
pub async fn collect(
    client: &tokio_postgres::Client,
    valkey: Option<crate::valkey::ValkeyConnection>,
    table: &TableName,
    publication: &str,
    slot: &str,
    relay_metrics: std::net::SocketAddr,
) -> Result<Status, tokio_postgres::Error> {
    let server = server_status(client).await?;
    // The columns of 17+ through to_jsonb, so that one query serves every version (NULL before).
    // On a standby the lag is measured against the WAL it replayed.
    let row = client
        .query_opt(
            "SELECT active, wal_status, confirmed_flush_lsn::text, \
                    (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                          ELSE pg_current_wal_lsn() END - confirmed_flush_lsn)::bigint, \
                    (to_jsonb(s) ->> 'failover')::bool, (to_jsonb(s) ->> 'synced')::bool, \
                    to_jsonb(s) ->> 'invalidation_reason' \
             FROM pg_replication_slots s WHERE slot_name = $1",
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
        failover: row.as_ref().and_then(|r| r.get(4)),
        synced: row.as_ref().and_then(|r| r.get(5)),
        invalidation_reason: row.as_ref().and_then(|r| r.get(6)),
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
    let relay = RelayView::read(relay_metrics).await;
    let warnings = warnings(&server, &slot, &relay);
    Ok(Status {
        server,
        slot,
        publication,
        table: table_status,
        unpublished_rows,
        oldest_unpublished_age_seconds: oldest,
        dead_letters,
        queues,
        relay,
        warnings,
    })
}

async fn server_status(
    client: &tokio_postgres::Client,
) -> Result<ServerStatus, tokio_postgres::Error> {
    let row = client
        .query_one(
            format!(
                "SELECT (SELECT system_identifier FROM pg_control_system())::text, {TIMELINE_SQL}, \
                        pg_is_in_recovery(), current_setting('server_version_num')::int"
            )
            .as_str(),
            &[],
        )
        .await?;
    Ok(ServerStatus {
        system_identifier: row.get(0),
        timeline: row.get::<_, i32>(1) as u32,
        role: if row.get(2) { "standby" } else { "primary" },
        version: row.get(3),
    })
}

/// What the server, the slot and the relay's view say together. PURE.
/// - The slot past the relay's acknowledgement: only the relay moves it (its slot was read
///   first, so the relay's acknowledgement read after is at least the slot's position), so
///   someone recreated or advanced it; the stream skips what lies between, the recovery poller
///   delivers it. Not said of a replica standing by (another one streams from the slot).
/// - The relay's last check on another timeline than the server's: it has not resumed since a
///   promotion (or it streams from another server).
pub fn warnings(server: &ServerStatus, slot: &SlotStatus, relay: &RelayView) -> Vec<String> {
    let mut out = Vec::new();
    if relay.unreachable.is_some() {
        return out;
    }
    let lsn = |s: &Option<String>| {
        s.as_deref()
            .and_then(|t| pgwire_replication::Lsn::parse(t).ok())
    };
    // A replica standing by: another session streams from the slot and moves it (found by
    // review: it warned for as long as the other replica streamed).
    let standing_by = relay.standby == Some(true);
    if let (Some(confirmed), Some(acked)) = (lsn(&slot.confirmed_flush_lsn), lsn(&relay.acked_lsn))
    {
        if confirmed > acked && !standing_by {
            out.push(format!(
                "the slot is at {confirmed}, past the relay's acknowledgement {acked}: it was \
                 recreated or advanced behind the relay's back (or the relay at {} streams from \
                 another slot); the stream skips what lies between, the recovery poller delivers it",
                relay.address
            ));
        }
    }
    if let Some(timeline) = relay.timeline.filter(|t| *t != 0) {
        if timeline != server.timeline {
            out.push(format!(
                "the relay last checked its slot on timeline {timeline}, the server is on \
                 timeline {}: it has not resumed since a promotion, or it streams from another \
                 server",
                server.timeline
            ));
        }
    }
    out
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
    let flag = |b: Option<bool>| b.map_or("-", yes);
    let _ = writeln!(
        out,
        "server       {:<24} timeline={} system={} version={}",
        s.server.role, s.server.timeline, s.server.system_identifier, s.server.version,
    );
    let _ = writeln!(
        out,
        "slot         {:<24} exists={} active={} wal_status={} confirmed={} lag={} failover={} synced={}",
        s.slot.name,
        yes(s.slot.exists),
        yes(s.slot.active),
        s.slot.wal_status.as_deref().unwrap_or("-"),
        s.slot.confirmed_flush_lsn.as_deref().unwrap_or("-"),
        s.slot
            .lag_bytes
            .map_or("-".into(), |b| format!("{b} bytes")),
        flag(s.slot.failover),
        flag(s.slot.synced),
    );
    if let Some(reason) = &s.slot.invalidation_reason {
        let _ = writeln!(out, "slot         invalidated: {reason}");
    }
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
    let r = &s.relay;
    match &r.unreachable {
        Some(why) => {
            let _ = writeln!(out, "relay        {:<24} unreachable ({why})", r.address);
        }
        None => {
            let changes = if r.slot_changes.values().all(|n| *n == 0) {
                "-".to_owned()
            } else {
                r.slot_changes
                    .iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(kind, n)| format!("{kind}:{n}"))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let count = |n: Option<u64>| n.map_or("-".into(), |n| n.to_string());
            let _ = writeln!(
                out,
                "relay        {:<24} stream_up={} standby={} timeline={} acked={} slot_changes={} slot_lost={} publication_recreated={}",
                r.address,
                flag(r.stream_up),
                flag(r.standby),
                r.timeline.map_or("-".into(), |t| t.to_string()),
                r.acked_lsn.as_deref().unwrap_or("-"),
                changes,
                count(r.slot_lost),
                count(r.publication_recreated),
            );
        }
    }
    for w in &s.warnings {
        let _ = writeln!(out, "WARNING      {w}");
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
        args.metrics_addr,
    )
    .await?;
    command::print(args.json, &status, render)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(timeline: u32) -> ServerStatus {
        ServerStatus {
            system_identifier: "7301".into(),
            timeline,
            role: "primary",
            version: 170006,
        }
    }

    fn slot(confirmed: Option<&str>) -> SlotStatus {
        SlotStatus {
            name: "outbox_relay".into(),
            exists: confirmed.is_some(),
            active: true,
            wal_status: Some("reserved".into()),
            confirmed_flush_lsn: confirmed.map(str::to_owned),
            lag_bytes: Some(0),
            failover: Some(true),
            synced: Some(false),
            invalidation_reason: None,
        }
    }

    fn relay(timeline: u32, acked: Option<&str>) -> RelayView {
        RelayView {
            address: "127.0.0.1:9187".into(),
            stream_up: Some(true),
            timeline: Some(timeline),
            acked_lsn: acked.map(str::to_owned),
            ..RelayView::default()
        }
    }

    #[test]
    fn a_slot_past_the_relays_acknowledgement_is_a_warning() {
        let w = warnings(&server(1), &slot(Some("0/3000")), &relay(1, Some("0/2000")));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("recreated or advanced behind the relay's back"));
        // At or behind the acknowledgement (the slot lags the relay's last reply): nothing.
        assert!(warnings(&server(1), &slot(Some("0/2000")), &relay(1, Some("0/2000"))).is_empty());
        assert!(warnings(&server(1), &slot(Some("0/1000")), &relay(1, Some("0/2000"))).is_empty());
        // Nothing acknowledged yet, or no slot: no comparison.
        assert!(warnings(&server(1), &slot(Some("0/3000")), &relay(1, None)).is_empty());
        assert!(warnings(&server(1), &slot(None), &relay(1, Some("0/2000"))).is_empty());
        // A replica standing by: another session moves the slot.
        let standing_by = RelayView {
            standby: Some(true),
            ..relay(1, Some("0/2000"))
        };
        assert!(warnings(&server(1), &slot(Some("0/3000")), &standing_by).is_empty());
    }

    #[test]
    fn a_relay_on_another_timeline_is_a_warning() {
        let w = warnings(&server(2), &slot(Some("0/1")), &relay(1, Some("0/1")));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("timeline 1, the server is on timeline 2"));
        // Before its first check the relay's timeline is 0.
        assert!(warnings(&server(2), &slot(Some("0/1")), &relay(0, Some("0/1"))).is_empty());
    }

    /// A status with every line and field filled in.
    fn full() -> Status {
        Status {
            server: server(1),
            slot: slot(Some("0/9")),
            publication: PublicationStatus {
                name: "outbox_relay".into(),
                exists: true,
                oid: Some(16390),
                tables: vec!["public.outbox_events".into()],
                operations: vec!["insert".into()],
            },
            table: TableStatus {
                name: "public.outbox_events".into(),
                exists: true,
                similar: Vec::new(),
            },
            unpublished_rows: Some(0),
            oldest_unpublished_age_seconds: Some(1.5),
            dead_letters: Some(0),
            queues: Some(vec![
                QueueStatus {
                    queue: "critical".into(),
                    pending: 1,
                },
                QueueStatus {
                    queue: "default".into(),
                    pending: 2,
                },
            ]),
            relay: RelayView {
                slot_changes: [("timeline".to_owned(), 1)].into(),
                slot_lost: Some(0),
                publication_recreated: Some(0),
                ..relay(1, Some("0/9"))
            },
            warnings: Vec::new(),
        }
    }

    /// The fenced block of `lang` that follows the heading `## \`outbox-relay status\`` in
    /// docs/observability.md.
    fn doc_sample(lang: &str) -> &'static str {
        const DOC: &str = include_str!("../docs/observability.md");
        let section = &DOC[DOC.find("## `outbox-relay status`").expect("the section")..];
        let start = section.find(&format!("```{lang}\n")).expect("the sample") + 4 + lang.len();
        &section[start..start + section[start..].find("```").unwrap()]
    }

    /// A line's shape: its first word and the names of its `key=value` fields.
    fn shape(line: &str) -> (String, Vec<String>) {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default().to_owned();
        let keys = words
            .filter_map(|w| w.split_once('=').map(|(k, _)| k.to_owned()))
            .collect();
        (first, keys)
    }

    #[test]
    fn the_documented_text_sample_has_the_real_lines_and_fields() {
        let real: Vec<_> = render(&full()).lines().map(shape).collect();
        let documented: Vec<_> = doc_sample("text").lines().map(shape).collect();
        assert_eq!(documented, real);
    }

    /// Every key path of a JSON value (array elements as their first one).
    fn key_paths(v: &serde_json::Value, at: &str, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let path = format!("{at}.{k}");
                    out.push(path.clone());
                    // Maps keyed by data (slot changes by kind) are not part of the shape.
                    if k != "slot_changes" {
                        key_paths(v, &path, out);
                    }
                }
            }
            serde_json::Value::Array(items) => {
                if let Some(first) = items.first() {
                    key_paths(first, &format!("{at}[]"), out);
                }
            }
            _ => {}
        }
    }

    #[test]
    fn the_documented_json_sample_has_the_real_keys() {
        let mut real = Vec::new();
        key_paths(&serde_json::to_value(full()).unwrap(), "", &mut real);
        let mut documented = Vec::new();
        let sample: serde_json::Value = serde_json::from_str(doc_sample("json")).unwrap();
        key_paths(&sample, "", &mut documented);
        real.sort();
        documented.sort();
        assert_eq!(documented, real);
    }

    #[test]
    fn an_unreachable_relay_gives_no_warning_and_is_shown() {
        let down = RelayView {
            address: "127.0.0.1:9187".into(),
            unreachable: Some("connection refused".into()),
            ..RelayView::default()
        };
        assert!(warnings(&server(2), &slot(Some("0/9")), &down).is_empty());
        let status = Status {
            server: server(2),
            queues: None,
            relay: down,
            ..full()
        };
        let text = render(&status);
        assert!(
            text.contains("relay        127.0.0.1:9187           unreachable (connection refused)"),
            "{text}"
        );
        assert!(text.contains("failover=yes synced=no"), "{text}");
        assert!(
            text.contains("server       primary                  timeline=2"),
            "{text}"
        );
    }
}
