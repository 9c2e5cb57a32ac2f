//! Which outbox rows an operator command looks at: `--since`/`--until` on `created_at`,
//! `--event-name` patterns and event ids, turned into one parameterised SQL condition, and the
//! rows read page by page (by `id`, so a large range never sits in memory at once).
//!
//! Shared by `trace` (its quick search), `replay` and `reconcile`.

use crate::pgoutput::TableName;
use clap::Args;
use std::time::Duration;
use tokio_postgres::types::ToSql;

/// A bound on `created_at`: a point in time, or a duration before now.
#[derive(Debug, Clone, PartialEq)]
pub enum TimeBound {
    /// RFC 3339, normalised to UTC (`2026-12-01T03:00:00Z`).
    At(String),
    Ago(Duration),
}

/// `2026-12-01T03:00:00Z`, `2026-12-01 03:00:00+01:00`, or a duration before now (`2h`, `7d`).
pub fn parse_time_bound(s: &str) -> Result<TimeBound, String> {
    let s = s.trim();
    if s.starts_with(|c: char| c.is_ascii_digit()) && s.len() >= 19 {
        let mut utc = String::new();
        crate::task::time::pg_timestamptz_to_rfc3339(s, &mut utc).map_err(|_| {
            format!(
                "{s:?} is not a time: use RFC 3339 with an offset (2026-12-01T03:00:00Z) \
                 or a duration before now (30m, 2h, 7d)"
            )
        })?;
        return Ok(TimeBound::At(utc));
    }
    crate::config::parse_duration(s)
        .map(TimeBound::Ago)
        .map_err(|e| format!("{e}; or a time in RFC 3339 (2026-12-01T03:00:00Z)"))
}

/// A UUID, as event ids are (checked before anything connects).
pub fn parse_event_id(s: &str) -> Result<String, String> {
    uuid::Uuid::parse_str(s.trim())
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| format!("{s:?} is not an event id (a UUID such as 0190f2a4-...)"))
}

/// An event name pattern: `*` matches any run of characters; anything else is literal.
pub fn parse_name_pattern(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("an empty event name matches nothing".into());
    }
    Ok(s.to_owned())
}

/// The pattern as SQL `LIKE` (backslash escapes `%`, `_` and itself).
fn like_pattern(glob: &str) -> String {
    let mut out = String::with_capacity(glob.len() + 4);
    for c in glob.chars() {
        match c {
            '*' => out.push('%'),
            '%' | '_' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// `--since`, `--until` and `--event-name`.
#[derive(Debug, Clone, Default, Args)]
pub struct EventFilter {
    /// Only rows created at or after this: a time in RFC 3339 (2026-12-01T03:00:00Z) or a
    /// duration before now (2h, 7d).
    #[arg(long, value_parser = parse_time_bound)]
    pub since: Option<TimeBound>,
    /// Only rows created before this (same forms as --since).
    #[arg(long, value_parser = parse_time_bound)]
    pub until: Option<TimeBound>,
    /// Only these event names; `*` matches any characters (`order.*`). Repeatable.
    #[arg(long = "event-name", num_args = 1.., value_parser = parse_name_pattern)]
    pub event_name: Vec<String>,
}

/// Which rows, by their delivery state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    Any,
    /// `published_at IS NOT NULL`.
    Published,
}

/// One row as the operator commands read it (text columns, as the stream and poller do).
#[derive(Debug, Clone)]
pub struct EventRow {
    pub id: i64,
    pub event_id: String,
    pub event_name: String,
    pub payload: String,
    pub metadata: Option<String>,
    pub created_at: String,
    pub published_at: Option<String>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub next_attempt_at: Option<String>,
    pub dead_at: Option<String>,
}

impl EventRow {
    /// The row as the task builder reads it.
    pub fn text(&self) -> crate::task::RowText<'_> {
        crate::task::RowText {
            id: None,
            event_id: &self.event_id,
            event_name: &self.event_name,
            payload: &self.payload,
            metadata: self.metadata.as_deref(),
            created_at: &self.created_at,
        }
    }
}

/// The columns read, in [`EventRow`] order.
pub const COLUMNS: &str =
    "id, event_id::text, coalesce(event_name, ''), coalesce(payload::text, 'null'), \
     metadata::text, created_at::text, published_at::text, attempts, last_error, \
     next_attempt_at::text, dead_at::text";

impl EventRow {
    pub fn from_row(r: &tokio_postgres::Row) -> Self {
        Self {
            id: r.get(0),
            event_id: r.get(1),
            event_name: r.get(2),
            payload: r.get(3),
            metadata: r.get(4),
            created_at: r.get(5),
            published_at: r.get(6),
            attempts: r.get(7),
            last_error: r.get(8),
            next_attempt_at: r.get(9),
            dead_at: r.get(10),
        }
    }
}

/// A SQL condition with its parameters (`$1`.. in order).
pub struct Condition {
    pub sql: String,
    pub params: Vec<Box<dyn ToSql + Sync + Send>>,
}

impl Condition {
    /// Adds ` AND clause`, where `$?` stands for the parameter's number.
    pub fn push(&mut self, clause: &str, param: Box<dyn ToSql + Sync + Send>) {
        self.params.push(param);
        let n = self.params.len();
        self.sql
            .push_str(&format!(" AND {}", clause.replace("$?", &format!("${n}"))));
    }

    pub fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect()
    }
}

impl EventFilter {
    /// True when no condition narrows the rows.
    pub fn is_empty(&self) -> bool {
        self.since.is_none() && self.until.is_none() && self.event_name.is_empty()
    }

    /// `WHERE ...` for these filters, the event ids (none: any) and the delivery state.
    pub fn condition(&self, event_ids: &[String], delivery: Delivery) -> Condition {
        let mut c = Condition {
            sql: "WHERE true".into(),
            params: Vec::new(),
        };
        let bound = |c: &mut Condition, op: &str, b: &TimeBound| match b {
            TimeBound::At(t) => c.push(
                &format!("created_at {op} $?::text::timestamptz"),
                Box::new(t.clone()),
            ),
            TimeBound::Ago(d) => c.push(
                &format!("created_at {op} now() - make_interval(secs => $?)"),
                Box::new(d.as_secs_f64()),
            ),
        };
        if let Some(b) = &self.since {
            bound(&mut c, ">=", b);
        }
        if let Some(b) = &self.until {
            bound(&mut c, "<", b);
        }
        if !self.event_name.is_empty() {
            let patterns: Vec<String> = self.event_name.iter().map(|p| like_pattern(p)).collect();
            c.push("event_name LIKE ANY($?)", Box::new(patterns));
        }
        if !event_ids.is_empty() {
            c.push("event_id::text = ANY($?)", Box::new(event_ids.to_vec()));
        }
        if delivery == Delivery::Published {
            c.sql.push_str(" AND published_at IS NOT NULL");
        }
        c
    }
}

/// Reads the rows matching a condition, `page` at a time in `id` order, so a large range
/// never sits in memory at once.
pub struct Pager<'a> {
    client: &'a tokio_postgres::Client,
    cond: &'a Condition,
    sql: String,
    limit: i64,
    after: i64,
    done: bool,
}

impl<'a> Pager<'a> {
    pub fn new(
        client: &'a tokio_postgres::Client,
        table: &TableName,
        cond: &'a Condition,
        page: usize,
    ) -> Self {
        let n = cond.params.len();
        let sql = format!(
            "SELECT {COLUMNS} FROM {} {} AND id > ${} ORDER BY id LIMIT ${}",
            table.sql(),
            cond.sql,
            n + 1,
            n + 2
        );
        Self {
            client,
            cond,
            sql,
            limit: i64::try_from(page).unwrap_or(i64::MAX),
            after: i64::MIN,
            done: false,
        }
    }

    /// The next page; `None` when the rows ran out.
    pub async fn next_page(&mut self) -> Result<Option<Vec<EventRow>>, tokio_postgres::Error> {
        if self.done {
            return Ok(None);
        }
        let mut params = self.cond.refs();
        params.push(&self.after);
        params.push(&self.limit);
        let rows: Vec<EventRow> = self
            .client
            .query(&self.sql, &params)
            .await?
            .iter()
            .map(EventRow::from_row)
            .collect();
        self.done = (rows.len() as i64) < self.limit;
        match rows.last() {
            Some(last) => {
                self.after = last.id;
                Ok(Some(rows))
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_bounds() {
        assert_eq!(
            parse_time_bound("2026-12-01T03:00:00Z").unwrap(),
            TimeBound::At("2026-12-01T03:00:00Z".into())
        );
        assert_eq!(
            parse_time_bound("2026-12-01 04:00:00+01:00").unwrap(),
            TimeBound::At("2026-12-01T03:00:00Z".into())
        );
        assert_eq!(
            parse_time_bound("2h").unwrap(),
            TimeBound::Ago(Duration::from_secs(7200))
        );
        for bad in [
            "",
            "yesterday",
            "2026-13-01T00:00:00Z",
            "2026-12-01T03:00:00",
        ] {
            assert!(parse_time_bound(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn name_patterns_are_literal_but_for_the_star() {
        assert_eq!(like_pattern("order.*"), "order.%");
        assert_eq!(like_pattern("a_b%c\\"), "a\\_b\\%c\\\\");
    }

    #[test]
    fn event_ids_must_be_uuids() {
        assert!(parse_event_id("42").is_err());
        assert_eq!(
            parse_event_id("0190F2A4-0000-7000-8000-000000000001").unwrap(),
            "0190f2a4-0000-7000-8000-000000000001"
        );
    }

    #[test]
    fn conditions_number_their_parameters() {
        let f = EventFilter {
            since: Some(TimeBound::Ago(Duration::from_secs(60))),
            until: Some(TimeBound::At("2026-12-01T03:00:00Z".into())),
            event_name: vec!["order.*".into()],
        };
        let c = f.condition(&["x".into()], Delivery::Published);
        assert_eq!(
            c.sql,
            "WHERE true AND created_at >= now() - make_interval(secs => $1) \
             AND created_at < $2::text::timestamptz AND event_name LIKE ANY($3) \
             AND event_id::text = ANY($4) AND published_at IS NOT NULL"
        );
        assert_eq!(c.params.len(), 4);
    }
}
