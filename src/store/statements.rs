//! The SQL on the outbox table: claiming unpublished rows (FOR UPDATE SKIP LOCKED), marking them
//! published or failed, dead letters and cleanup. Statement texts are built once per table.
//!
//! Rows are read as text (`::text`), the same representation the replication stream decodes,
//! so both paths build byte-identical tasks through [`crate::task`].

use crate::pgoutput::TableName;
use crate::task::{BadRow, RowText};
use std::time::Duration;
use tokio_postgres::{GenericClient, Row};

/// A claimed row, as text columns. Columns are nullable here: a table without the kit's NOT
/// NULL constraints must give a bad row, never a crash.
#[derive(Debug, Clone)]
pub struct ClaimedRow {
    pub id: i64,
    pub event_id: Option<String>,
    pub event_name: Option<String>,
    pub payload: Option<String>,
    pub metadata: Option<String>,
    pub created_at: Option<String>,
    pub attempts: i32,
}

/// What one claim keeps: its rows, and whether the byte bound left locked rows for the next round.
#[derive(Debug, Clone, Default)]
pub struct Claimed {
    /// The rows to deliver this round, in id order.
    pub rows: Vec<ClaimedRow>,
    /// Rows were left for the next round by the byte bound: the poller claims again at once,
    /// as after a full batch.
    pub left: bool,
}

impl ClaimedRow {
    fn from_row(r: &Row) -> Self {
        Self {
            id: r.get(0),
            event_id: r.get(1),
            event_name: r.get(2),
            payload: r.get(3),
            metadata: r.get(4),
            created_at: r.get(5),
            attempts: r.get(6),
        }
    }

    /// The row as the task builder reads it; a NULL required column is a bad row.
    pub fn text(&self) -> Result<RowText<'_>, BadRow> {
        fn req<'a>(v: &'a Option<String>, name: &'static str) -> Result<&'a str, BadRow> {
            v.as_deref().ok_or(BadRow::MissingColumn(name))
        }
        Ok(RowText {
            id: None,
            event_id: req(&self.event_id, "event_id")?,
            event_name: req(&self.event_name, "event_name")?,
            payload: req(&self.payload, "payload")?,
            metadata: self.metadata.as_deref(),
            created_at: req(&self.created_at, "created_at")?,
        })
    }

    /// For logs: the event id, or empty when NULL.
    pub fn event_id(&self) -> &str {
        self.event_id.as_deref().unwrap_or("")
    }

    /// For logs and metrics: the event name, or empty when NULL.
    pub fn event_name(&self) -> &str {
        self.event_name.as_deref().unwrap_or("")
    }
}

/// A dead letter, for operators.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetter {
    pub id: i64,
    pub event_id: String,
    pub event_name: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub created_at: String,
    pub dead_at: String,
}

/// The statement [`Store::mark_delivered_returning`] sends for `table` (its SQL text, as
/// [`TableName::sql`] gives it): an UPDATE setting `published_at`, or with `delete_delivered` a
/// DELETE, of the rows matching the pairs of `$1` (ids, `bigint[]`) and `$2` (event ids,
/// `uuid[]`), returning the ids found. bench/mark_cost.py measures copies of both, held equal
/// by tests/bench_statements.rs.
pub fn mark_delivered_sql(table: &str, delete_delivered: bool) -> String {
    let t = table;
    if delete_delivered {
        format!(
            "DELETE FROM {t} o USING unnest($1::bigint[], $2::uuid[]) AS d(id, event_id) \
             WHERE o.id = d.id AND o.event_id = d.event_id RETURNING o.id"
        )
    } else {
        format!(
            "UPDATE {t} o SET published_at = now() \
             FROM unnest($1::bigint[], $2::uuid[]) AS d(id, event_id) \
             WHERE o.id = d.id AND o.event_id = d.event_id AND o.published_at IS NULL \
             RETURNING o.id"
        )
    }
}

/// The statements for one outbox table.
#[derive(Debug, Clone)]
pub struct Store {
    table: TableName,
    claim: String,
    claim_recovery: String,
    /// Delete delivered rows instead of setting `published_at`.
    delete_delivered: bool,
}

impl Store {
    pub fn new(table: TableName) -> Self {
        let t = table.sql();
        // Lock the ids first, then read (and cast to text) only those rows: a plan that reads
        // and casts every unpublished row before the LIMIT is far slower on a big backlog
        // whose statistics are stale.
        //
        // Rows are kept in id order until `bytes` (the first row whatever its size): first cut
        // here by their stored size (`pg_column_size`, which reads no TOAST), then by their
        // text as the relay reads it ([`Store::claim`]), since a compressed payload stores
        // much smaller than it reads. Nothing sorts text (found by review, twice: a window
        // over every locked row's text, then a final sort of the returned rows' text, wrote
        // them to temp files and failed every round under a lower `temp_file_limit`): the
        // window sorts ids and sizes, the final sort stored values (TOAST pointers), and the
        // casts run above it (`OFFSET 0` keeps the planner from pulling them below; the outer
        // ORDER BY is met by the inner sort, with no sort of its own). The rows locked past
        // the cut are unlocked unchanged at commit, for the next round; `locked` tells the
        // poller some were left.
        let claim = |extra: &str| {
            let size = "coalesce(pg_column_size(o.payload), 0) \
                        + coalesce(pg_column_size(o.metadata), 0)";
            format!(
                "WITH c AS (SELECT id FROM {t} WHERE published_at IS NULL AND dead_at IS NULL \
                   AND (next_attempt_at IS NULL OR next_attempt_at <= now()){extra} \
                   ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED), \
                 w AS (SELECT o.id, sum({size}) OVER (ORDER BY o.id ROWS UNBOUNDED PRECEDING) \
                          - ({size}) AS before, count(*) OVER () AS locked \
                   FROM {t} o JOIN c ON o.id = c.id) \
                 SELECT id, event_id::text, event_name, payload::text, metadata::text, \
                        created_at::text, attempts, locked \
                 FROM (SELECT o.id, o.event_id, o.event_name, o.payload, o.metadata, \
                              o.created_at, o.attempts, w.locked \
                       FROM {t} o JOIN w ON o.id = w.id WHERE w.before < $2 \
                       ORDER BY o.id OFFSET 0) k ORDER BY id"
            )
        };
        Self {
            claim: claim(""),
            // A row without created_at (a table without the kit's NOT NULL) is not the
            // stream's to wait for: claimed at once, it becomes a dead letter as a bad row.
            claim_recovery: claim(
                " AND (created_at IS NULL OR created_at < now() - make_interval(secs => $3))",
            ),
            table,
            delete_delivered: false,
        }
    }

    /// Deletes delivered rows instead of marking them published (much less WAL; no history).
    pub fn deleting_delivered(mut self, delete: bool) -> Self {
        self.delete_delivered = delete;
        self
    }

    /// Locks up to `limit` deliverable rows no other transaction holds, oldest id first, and
    /// keeps them until `bytes` of payload and metadata text (the first row whatever its size):
    /// what a round holds is bounded by bytes as well as by rows. With `older_than`, only rows
    /// created at least that long ago (the recovery path beside the stream).
    pub async fn claim(
        &self,
        tx: &impl GenericClient,
        limit: usize,
        bytes: usize,
        older_than: Option<Duration>,
    ) -> Result<Claimed, tokio_postgres::Error> {
        use futures::TryStreamExt;
        use tokio_postgres::types::ToSql;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // At least the first row, whatever its size.
        let bytes = bytes.max(1);
        let server_bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        let secs = older_than.map(|d| d.as_secs_f64());
        let (sql, params): (&str, Vec<&(dyn ToSql + Sync)>) = match &secs {
            None => (&self.claim, vec![&limit, &server_bytes]),
            Some(secs) => (&self.claim_recovery, vec![&limit, &server_bytes, secs]),
        };
        let stream = tx.query_raw(sql, params).await?;
        futures::pin_mut!(stream);
        let mut claimed = Claimed::default();
        let (mut read, mut locked) = (0, 0);
        while let Some(row) = stream.try_next().await? {
            locked = row.get::<_, i64>(7);
            if read >= bytes {
                // Left for the next round. The rest of the answer still comes (Postgres has
                // cast it already; tokio-postgres would read it even if the stream were
                // dropped): only what is kept is bounded here.
                claimed.left = true;
                continue;
            }
            let row = ClaimedRow::from_row(&row);
            read += row.payload.as_ref().map_or(0, String::len)
                + row.metadata.as_ref().map_or(0, String::len);
            claimed.rows.push(row);
        }
        claimed.left |= usize::try_from(locked).unwrap_or(usize::MAX) > claimed.rows.len();
        Ok(claimed)
    }

    /// Marks rows published (rows already marked are left alone).
    pub async fn mark_published(
        &self,
        client: &impl GenericClient,
        ids: &[i64],
    ) -> Result<u64, tokio_postgres::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        client.execute(&self.settle_sql(false), &[&ids]).await
    }

    /// Marks claimed rows published, or deletes them with `delete_delivered`.
    fn settle_sql(&self, returning: bool) -> String {
        let ret = if returning { " RETURNING id" } else { "" };
        if self.delete_delivered {
            format!("DELETE FROM {} WHERE id = ANY($1){ret}", self.table.sql())
        } else {
            format!(
                "UPDATE {} SET published_at = now() WHERE id = ANY($1) AND published_at IS NULL{ret}",
                self.table.sql()
            )
        }
    }

    /// Marks the rows the stream delivered published (or deletes them), each matched by its id
    /// AND its event_id: after a failover, the new primary can give an id that the old one
    /// used for an event it never replicated to another event, which must not be marked. Returns
    /// the ids it marked (rows already marked, or not yet visible, are not among them).
    pub async fn mark_delivered_returning(
        &self,
        client: &impl GenericClient,
        rows: &[(i64, uuid::Uuid)],
    ) -> Result<Vec<i64>, tokio_postgres::Error> {
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let event_ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.1).collect();
        let sql = mark_delivered_sql(&self.table.sql(), self.delete_delivered);
        Ok(client
            .query(&sql, &[&ids, &event_ids])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect())
    }

    /// The rows the table holds with any of `event_ids`: (event_id, id, event_name), at most
    /// 100,000. Used only when the table has no unique index on event_id
    /// (crate::shared_event_ids).
    pub async fn rows_sharing_event_ids(
        &self,
        client: &impl GenericClient,
        event_ids: &[uuid::Uuid],
    ) -> Result<Vec<(uuid::Uuid, i64, String)>, tokio_postgres::Error> {
        let sql = format!(
            "SELECT event_id, id, event_name FROM {} WHERE event_id = ANY($1) LIMIT 100000",
            self.table.sql()
        );
        Ok(client
            .query(&sql, &[&event_ids])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect())
    }

    /// Records a failed attempt: the next one waits `backoff * 2^(attempts-1)` (at most an
    /// hour), and the row becomes a dead letter at `max_attempts`.
    ///
    /// The hour is applied to the seconds, before `make_interval`, and the exponent stays in
    /// 0..=60 (any backoff of 1 ns or more reaches the hour by then; a hand-edited negative
    /// count underflows no more): at 40 attempts of 10 s the uncapped delay wrapped around
    /// (`timestamp out of range`; from 100,000 attempts `value out of range: overflow`), the
    /// UPDATE failed, and the poller's round with it, every round, so the row never became a
    /// dead letter and stalled the poller (found by review).
    pub async fn mark_failed(
        &self,
        client: &impl GenericClient,
        id: i64,
        error: &str,
        backoff: Duration,
        max_attempts: i32,
    ) -> Result<bool, tokio_postgres::Error> {
        let sql = format!(
            "UPDATE {} SET attempts = attempts + 1, last_error = $2, \
               next_attempt_at = now() + make_interval(secs => \
                 least($3 * power(2::float8, greatest(least(attempts, 60), 0)), 3600)), \
               dead_at = CASE WHEN attempts + 1 >= $4 THEN now() END \
             WHERE id = $1 RETURNING dead_at IS NOT NULL",
            self.table.sql()
        );
        let row = client
            .query_one(&sql, &[&id, &error, &backoff.as_secs_f64(), &max_attempts])
            .await?;
        Ok(row.get(0))
    }

    /// Unpublished rows and the age of the oldest (seconds).
    pub async fn unpublished(
        &self,
        client: &impl GenericClient,
    ) -> Result<(i64, Option<f64>), tokio_postgres::Error> {
        let sql = format!(
            "SELECT count(*), extract(epoch FROM now() - min(created_at))::float8 FROM {} \
             WHERE published_at IS NULL AND dead_at IS NULL",
            self.table.sql()
        );
        let row = client.query_one(&sql, &[]).await?;
        Ok((row.get(0), row.get(1)))
    }

    pub async fn dead_letters_count(
        &self,
        client: &impl GenericClient,
    ) -> Result<i64, tokio_postgres::Error> {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE dead_at IS NOT NULL AND published_at IS NULL",
            self.table.sql()
        );
        Ok(client.query_one(&sql, &[]).await?.get(0))
    }

    pub async fn dead_letters(
        &self,
        client: &impl GenericClient,
    ) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
        let sql = format!(
            "SELECT id, event_id::text, event_name, attempts, last_error, created_at::text, dead_at::text \
             FROM {} WHERE dead_at IS NOT NULL AND published_at IS NULL ORDER BY id",
            self.table.sql()
        );
        Ok(client
            .query(&sql, &[])
            .await?
            .iter()
            .map(|r| DeadLetter {
                id: r.get(0),
                event_id: r.get(1),
                event_name: r.get(2),
                attempts: r.get(3),
                last_error: r.get(4),
                created_at: r.get(5),
                dead_at: r.get(6),
            })
            .collect())
    }

    /// Makes dead letters deliverable again (all of them, or those with the given event ids).
    pub async fn retry_dead_letters(
        &self,
        client: &impl GenericClient,
        event_ids: Option<&[String]>,
    ) -> Result<u64, tokio_postgres::Error> {
        let base = format!(
            "UPDATE {} SET attempts = 0, dead_at = NULL, next_attempt_at = NULL, last_error = NULL \
             WHERE dead_at IS NOT NULL AND published_at IS NULL",
            self.table.sql()
        );
        match event_ids {
            None => client.execute(&base, &[]).await,
            Some(ids) => {
                let sql = format!("{base} AND event_id::text = ANY($1)");
                client.execute(&sql, &[&ids]).await
            }
        }
    }

    /// Deletes up to `limit` rows published more than `older_than` ago; returns how many.
    pub async fn delete_published(
        &self,
        client: &impl GenericClient,
        older_than: Duration,
        limit: i64,
    ) -> Result<u64, tokio_postgres::Error> {
        let t = self.table.sql();
        let sql = format!(
            "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE published_at IS NOT NULL \
             AND published_at < now() - make_interval(secs => $1) LIMIT $2)"
        );
        client
            .execute(&sql, &[&older_than.as_secs_f64(), &limit])
            .await
    }

    /// How many rows [`delete_published`](Self::delete_published) would delete, all batches
    /// together (`cleanup --dry-run`).
    pub async fn count_published(
        &self,
        client: &impl GenericClient,
        older_than: Duration,
    ) -> Result<u64, tokio_postgres::Error> {
        let t = self.table.sql();
        let sql = format!(
            "SELECT count(*) FROM {t} WHERE published_at IS NOT NULL \
             AND published_at < now() - make_interval(secs => $1)"
        );
        let n: i64 = client
            .query_one(&sql, &[&older_than.as_secs_f64()])
            .await?
            .get(0);
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
