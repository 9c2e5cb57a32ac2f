//! The producer side: writes one outbox row inside the caller's own transaction, so the event
//! commits or rolls back with the business change.
//!
//! [`Event`] is validated as the relay validates a row (a non-empty name; metadata is a string
//! map by type) plus what PostgreSQL itself refuses (NUL characters in `text` and `jsonb`), so a
//! row written through it never becomes a bad row (given [`Outbox::with_max_payload_bytes`] at
//! the relay's limit). [`Outbox::insert`] is one parameterised
//! `INSERT` on any [`tokio_postgres::GenericClient`] (a `Transaction`, or a `Client` outside a
//! transaction); only the table name, a validated [`TableName`], is formatted into the SQL.
//!
//! There is no sqlx variant: it would bring a second PostgreSQL driver and its compile time into
//! this crate for one statement. With sqlx, bind the same four values yourself (see
//! `docs/producers.md`).
//!
//! ```no_run
//! use outbox_relay::producer::{Event, Outbox};
//! # async fn place_order(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! let tx = client.transaction().await?;
//! tx.execute("INSERT INTO orders (id, total) VALUES ($1, $2)", &[&42_i64, &4250_i64]).await?;
//! let event = Event::new("order.placed", &serde_json::json!({ "order_id": 42, "total": 4250 }))?
//!     .with_trace_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)?;
//! Outbox::default().insert(&tx, &event).await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

use crate::pgoutput::TableName;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{Json, Type};
use tokio_postgres::GenericClient;
use uuid::Uuid;

/// Why an event cannot be written. Validation errors come before any SQL is sent, so the
/// caller's transaction is still usable after them.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    #[error("event name is empty")]
    EmptyName,
    #[error("the payload cannot be serialised as JSON")]
    Payload(#[source] serde_json::Error),
    #[error(
        "the event's {0} contains a NUL character, which PostgreSQL text and jsonb cannot hold"
    )]
    Nul(&'static str),
    #[error("traceparent {0:?} is not `00-<32 hex>-<16 hex>-<2 hex>` with non-zero ids (W3C)")]
    InvalidTraceparent(String),
    #[error("tracestate is not a W3C list of at most 32 key=value members")]
    InvalidTracestate,
    /// The payload as PostgreSQL prints it (what the relay measures) is over the limit.
    #[error("payload is {size} bytes as jsonb text, over the {limit}-byte limit")]
    PayloadTooLarge { size: usize, limit: usize },
    #[error("event_id {id} is already in the outbox")]
    DuplicateEventId {
        id: Uuid,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("outbox insert failed")]
    Database(#[source] tokio_postgres::Error),
}

/// One outbox event: the row's `event_id`, `event_name`, `payload` and `metadata`
/// (`created_at` is the table's `now()` default, the Envelope's `occurred_at`).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    id: Uuid,
    name: String,
    payload: Value,
    metadata: BTreeMap<String, String>,
}

impl Event {
    /// An event with a new random (v4) id. Fails on an empty name, a payload that does not
    /// serialise, or a NUL character in either.
    pub fn new(name: impl Into<String>, payload: &impl Serialize) -> Result<Self, ProducerError> {
        let name = name.into();
        if name.is_empty() {
            return Err(ProducerError::EmptyName);
        }
        if name.contains('\0') {
            return Err(ProducerError::Nul("name"));
        }
        let payload = serde_json::to_value(payload).map_err(ProducerError::Payload)?;
        if has_nul(&payload) {
            return Err(ProducerError::Nul("payload"));
        }
        Ok(Self {
            id: Uuid::new_v4(),
            name,
            payload,
            metadata: BTreeMap::new(),
        })
    }

    /// Sets the id (the TaskID and the Envelope's `id`): a v7 UUID, or one derived from the
    /// business key so that a retried request cannot enqueue the event twice.
    pub fn with_id(mut self, id: Uuid) -> Self {
        self.id = id;
        self
    }

    /// Adds a metadata entry (the Go kit decodes metadata as `map[string]string`). The keys
    /// `traceparent`, `tracestate` and `baggage` also become asynq task headers.
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Sets the W3C trace context: `traceparent` (version `00`, lowercase hex, non-zero trace
    /// and parent ids) and, when given, `tracestate`; `None` removes an earlier `tracestate`.
    pub fn with_trace_context(
        mut self,
        traceparent: &str,
        tracestate: Option<&str>,
    ) -> Result<Self, ProducerError> {
        if !valid_traceparent(traceparent) {
            return Err(ProducerError::InvalidTraceparent(traceparent.to_owned()));
        }
        self.metadata
            .insert("traceparent".into(), traceparent.to_owned());
        match tracestate {
            Some(state) if !valid_tracestate(state) => {
                return Err(ProducerError::InvalidTracestate)
            }
            Some(state) => self.metadata.insert("tracestate".into(), state.to_owned()),
            None => self.metadata.remove("tracestate"),
        };
        Ok(self)
    }

    /// The `event_id`: the asynq TaskID and the Envelope's `id`.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// The `event_name`; the task type is `event:` + name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The payload, stored as `jsonb`.
    pub fn payload(&self) -> &Value {
        &self.payload
    }

    /// The metadata, stored as a `jsonb` object of strings.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

/// Where events are written: a table with the Go kit's columns, and optionally the relay's
/// payload limit (`OUTBOX_MAX_PAYLOAD_BYTES`) checked at insert time.
#[derive(Debug, Clone)]
pub struct Outbox {
    table: TableName,
    max_payload_bytes: Option<usize>,
}

impl Default for Outbox {
    /// `outbox_events` (found through `search_path`), no payload limit.
    fn default() -> Self {
        Self::new(TableName {
            schema: None,
            table: "outbox_events".into(),
        })
    }
}

impl Outbox {
    /// Writes to `table` (`schema.table`, or a bare name resolved through `search_path`).
    pub fn new(table: TableName) -> Self {
        Self {
            table,
            max_payload_bytes: None,
        }
    }

    /// Refuses payloads whose `jsonb` text, as PostgreSQL prints it and the relay measures it,
    /// is longer than `limit` bytes. PostgreSQL does the measuring, in the INSERT itself: its
    /// text differs from serde_json's (`": "` and `", "` separators, numbers without exponent).
    pub fn with_max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = Some(limit);
        self
    }

    /// Inserts `event` on `client`, normally the caller's open transaction. One statement, one
    /// round trip. A refused payload size inserts nothing and leaves the transaction usable; a
    /// database error (a duplicate `event_id` included) aborts it, as any failed statement does.
    pub async fn insert(
        &self,
        client: &impl GenericClient,
        event: &Event,
    ) -> Result<(), ProducerError> {
        if event
            .metadata
            .iter()
            .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(ProducerError::Nul("metadata"));
        }
        let limit = self
            .max_payload_bytes
            .map(|l| i64::try_from(l).unwrap_or(i64::MAX));
        // Without a limit, `$5 IS NULL` makes the WHERE true and the payload is not measured.
        let sql = format!(
            "INSERT INTO {} (event_id, event_name, payload, metadata) \
             SELECT $1, $2, $3, $4 WHERE $5 IS NULL OR octet_length($3::text) <= $5",
            self.table.sql()
        );
        let inserted = client
            .execute_typed(
                &sql,
                &[
                    (&event.id, Type::UUID),
                    (&event.name, Type::TEXT),
                    (&event.payload, Type::JSONB),
                    (&Json(&event.metadata), Type::JSONB),
                    (&limit, Type::INT8),
                ],
            )
            .await
            .map_err(|e| db_error(e, event.id))?;
        match self.max_payload_bytes {
            Some(limit) if inserted == 0 => {
                let row = client
                    .query_typed_one(
                        "SELECT octet_length($1::text)::int8",
                        &[(&event.payload, Type::JSONB)],
                    )
                    .await
                    .map_err(ProducerError::Database)?;
                let size = usize::try_from(row.get::<_, i64>(0)).unwrap_or(usize::MAX);
                Err(ProducerError::PayloadTooLarge { size, limit })
            }
            _ => Ok(()),
        }
    }
}

fn db_error(e: tokio_postgres::Error, id: Uuid) -> ProducerError {
    // The kit's table has one unique column a caller sets: event_id (id is an identity).
    if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
        ProducerError::DuplicateEventId { id, source: e }
    } else {
        ProducerError::Database(e)
    }
}

/// Whether any string or key of `v` holds a NUL, which `jsonb` refuses (`\u0000`).
fn has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

/// `00-<32 hex>-<16 hex>-<2 hex>`, lowercase, trace id and parent id not all zeros.
fn valid_traceparent(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: &[u8]| r.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    let nonzero = |r: &[u8]| r.iter().any(|c| *c != b'0');
    b.len() == 55
        && b.starts_with(b"00-")
        && b[35] == b'-'
        && b[52] == b'-'
        && hex(&b[3..35])
        && nonzero(&b[3..35])
        && hex(&b[36..52])
        && nonzero(&b[36..52])
        && hex(&b[53..55])
}

/// A W3C tracestate: comma-separated `key=value` members (empty ones allowed), at most 32.
fn valid_tracestate(s: &str) -> bool {
    let key_char = |c: char| matches!(c, 'a'..='z' | '0'..='9' | '_' | '-' | '*' | '/' | '@');
    let value_char = |c: char| matches!(c, ' '..='~') && c != ',' && c != '=';
    let mut members = 0;
    for member in s.split(',').map(|m| m.trim_matches([' ', '\t'])) {
        if member.is_empty() {
            continue;
        }
        members += 1;
        let Some((key, value)) = member.split_once('=') else {
            return false;
        };
        let key_ok = (1..=256).contains(&key.len()) && key.chars().all(key_char);
        let value_ok = (1..=256).contains(&value.len()) && value.chars().all(value_char);
        if !key_ok || !value_ok || members > 32 {
            return false;
        }
    }
    members > 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn builds_a_typed_event() {
        let id = Uuid::parse_str("0b9e5a0c-6c1f-4d6e-9a57-2f1f3c0e8d11").unwrap();
        let e = Event::new("order.placed", &json!({ "order_id": 42 }))
            .unwrap()
            .with_id(id)
            .with_metadata("tenant", "acme")
            .with_trace_context(TP, Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"))
            .unwrap();
        assert_eq!((e.id(), e.name()), (id, "order.placed"));
        assert_eq!(e.payload(), &json!({ "order_id": 42 }));
        let keys: Vec<&str> = e.metadata().keys().map(String::as_str).collect();
        assert_eq!(keys, ["tenant", "traceparent", "tracestate"]);
        let e = e.with_trace_context(TP, None).unwrap();
        assert!(!e.metadata().contains_key("tracestate"), "None clears it");
        assert_ne!(
            Event::new("a", &1).unwrap().id(),
            Event::new("a", &1).unwrap().id()
        );
    }

    #[test]
    fn refuses_what_the_relay_or_postgres_would() {
        assert!(matches!(
            Event::new("", &json!({})),
            Err(ProducerError::EmptyName)
        ));
        assert!(matches!(
            Event::new("a\0b", &1),
            Err(ProducerError::Nul("name"))
        ));
        for payload in [
            json!("x\u{0}"),
            json!({ "k\u{0}": 1 }),
            json!([[{ "k": "\u{0}" }]]),
        ] {
            assert!(matches!(
                Event::new("a", &payload),
                Err(ProducerError::Nul("payload"))
            ));
        }
        let bad_map: BTreeMap<(i32, i32), i32> = [((1, 2), 3)].into();
        assert!(matches!(
            Event::new("a", &bad_map),
            Err(ProducerError::Payload(_))
        ));
    }

    #[test]
    fn traceparent_follows_w3c() {
        assert!(valid_traceparent(TP));
        assert!(valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        ));
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bg-01",
        ] {
            let e = Event::new("a", &1).unwrap().with_trace_context(bad, None);
            assert!(
                matches!(e, Err(ProducerError::InvalidTraceparent(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn tracestate_follows_w3c() {
        for good in ["rojo=00f067aa0ba902b7", " a=1 ,, b@vendor=x y ", "t*/_-9=v"] {
            assert!(valid_tracestate(good), "{good:?}");
        }
        let too_many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        for bad in [
            "",
            " , ",
            "novalue",
            "=v",
            "K=v",
            "k=",
            "k=a=b",
            "k=\u{e9}",
            &too_many.join(","),
        ] {
            assert!(!valid_tracestate(bad), "{bad:?}");
        }
        let e = Event::new("a", &1)
            .unwrap()
            .with_trace_context(TP, Some("k="));
        assert!(matches!(e, Err(ProducerError::InvalidTracestate)));
    }
}
