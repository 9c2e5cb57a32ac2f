//! Outbox row -> asynq task: exactly what the Go kit's own relay enqueues.
//!
//! Pure and synchronous. The stream and the poller both hand rows here as text columns, so both
//! paths produce byte-identical tasks. A row that cannot become a task is a [`BadRow`]: the
//! caller logs and counts it and leaves the row to the recovery path; it never stops a stream.

pub mod json;
mod message;
pub mod time;

pub use message::{encode_task, TaskFields, TaskMessage};

use std::collections::BTreeMap;
use std::sync::Arc;

/// Metadata keys that carry W3C trace context; copied to the TaskMessage headers (field 15).
pub const TRACE_HEADERS: [&str; 3] = ["baggage", "traceparent", "tracestate"];

/// What goes into the task payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PayloadFormat {
    /// The Go kit's Envelope JSON (`id`, `name`, `payload`, `metadata`, `occurred_at`).
    Envelope,
    /// The row's `payload` JSON alone, for consumers that do not use the kit.
    Raw,
}

/// Routes event names to queues: `name=queue` (exact) or `prefix*=queue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueRoute {
    pattern: String,
    prefix: bool,
    queue: Arc<str>,
}

impl QueueRoute {
    /// Parses one `pattern=queue` item.
    pub fn parse(item: &str) -> Result<Self, String> {
        let (pattern, queue) = item
            .split_once('=')
            .ok_or_else(|| format!("route {item:?} is not of the form event.name=queue"))?;
        let (pattern, queue) = (pattern.trim(), queue.trim());
        if pattern.is_empty() || queue.is_empty() {
            return Err(format!("route {item:?} has an empty event name or queue"));
        }
        let (pattern, prefix) = match pattern.strip_suffix('*') {
            Some(p) => (p, true),
            None => (pattern, false),
        };
        Ok(Self {
            pattern: pattern.to_owned(),
            prefix,
            queue: Arc::from(queue),
        })
    }

    fn matches(&self, name: &str) -> bool {
        if self.prefix {
            name.starts_with(&self.pattern)
        } else {
            name == self.pattern
        }
    }
}

/// Everything about a task that comes from configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSettings {
    /// Prepended to the event name to form the task type (`event:` for the Go kit).
    pub type_prefix: String,
    pub payload_format: PayloadFormat,
    pub default_queue: Arc<str>,
    /// First match wins; no match means `default_queue`.
    pub routes: Vec<QueueRoute>,
    pub max_retry: i32,
    pub timeout_secs: i64,
    pub retention_secs: i64,
    /// Rows whose payload is larger are bad rows (dead letters), not tasks.
    pub max_payload_bytes: usize,
}

/// The relay's defaults, those of `outbox-relay run` (and of `trace`, `replay`, `reconcile`)
/// given no task setting (docs/configuration.md): type `event:` and the event name, the Go
/// kit's Envelope payload, queue `default`, MaxRetry 25, a 30-minute timeout, kept 24 hours
/// once done, payloads up to 1 MiB. The flags' defaults are held to this by a unit test
/// (`src/config/run.rs`).
impl Default for TaskSettings {
    fn default() -> Self {
        TaskSettings {
            type_prefix: "event:".into(),
            payload_format: PayloadFormat::Envelope,
            default_queue: Arc::from("default"),
            routes: Vec::new(),
            max_retry: 25,
            timeout_secs: 30 * 60,
            retention_secs: 24 * 60 * 60,
            max_payload_bytes: 1 << 20,
        }
    }
}

impl TaskSettings {
    /// The queue an event goes to.
    pub fn queue_for(&self, event_name: &str) -> &Arc<str> {
        self.routes
            .iter()
            .find(|r| r.matches(event_name))
            .map_or(&self.default_queue, |r| &r.queue)
    }

    /// Every queue a task can go to.
    pub fn queues(&self) -> Vec<Arc<str>> {
        let mut qs: Vec<Arc<str>> = vec![self.default_queue.clone()];
        for r in &self.routes {
            if !qs.contains(&r.queue) {
                qs.push(r.queue.clone());
            }
        }
        qs
    }
}

/// An outbox row as text columns, as both the stream and the poller read it.
#[derive(Debug, Clone, Copy)]
pub struct RowText<'a> {
    /// The `id` bigint, when the table has it (used to mark the row published).
    pub id: Option<&'a str>,
    pub event_id: &'a str,
    pub event_name: &'a str,
    pub payload: &'a str,
    /// `None` when the column is absent.
    pub metadata: Option<&'a str>,
    pub created_at: &'a str,
}

/// A task ready for Valkey.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub queue: Arc<str>,
    /// TaskID = the row's event_id, canonical lowercase UUID text.
    pub id: String,
    /// The TaskMessage bytes (the hash's `msg` field).
    pub msg: Vec<u8>,
    /// The row's `id`, to mark it published.
    pub row_id: Option<i64>,
}

/// Why a row cannot become a task. The message never contains the payload.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BadRow {
    #[error("event_name is empty")]
    EmptyEventName,
    #[error("event_id {0:?} is not a UUID")]
    InvalidEventId(String),
    #[error("payload is {size} bytes, over the {limit}-byte limit")]
    PayloadTooLarge { size: usize, limit: usize },
    /// `event_name` or `metadata` longer than the payload's limit: both are copied into the
    /// task, escaped (up to six bytes a character), so without a bound one row could make a
    /// task too large for Valkey's `proto-max-bulk-len`, and every write that carried it would
    /// fail for ever, or exhaust the relay's memory (found by review).
    #[error("{column} is {size} bytes, over the {limit}-byte limit (OUTBOX_MAX_PAYLOAD_BYTES)")]
    ColumnTooLarge {
        column: &'static str,
        size: usize,
        limit: usize,
    },
    #[error("metadata is not a JSON object")]
    MetadataNotObject,
    #[error("metadata value for key {0:?} is not a string (the Go kit decodes map[string]string)")]
    MetadataValueNotString(String),
    #[error(transparent)]
    Timestamp(#[from] time::TimestampError),
    #[error("row lacks required column {0}")]
    MissingColumn(&'static str),
    #[error("id {0:?} is not a bigint")]
    InvalidRowId(String),
    #[error("{0}")]
    Column(String),
}

impl BadRow {
    /// A short stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            BadRow::EmptyEventName => "empty_event_name",
            BadRow::InvalidEventId(_) => "invalid_event_id",
            BadRow::PayloadTooLarge { .. } => "payload_too_large",
            BadRow::ColumnTooLarge { .. } => "column_too_large",
            BadRow::MetadataNotObject => "metadata_not_object",
            BadRow::MetadataValueNotString(_) => "metadata_not_string",
            BadRow::Timestamp(_) => "invalid_created_at",
            BadRow::MissingColumn(_) => "missing_column",
            BadRow::InvalidRowId(_) => "invalid_row_id",
            BadRow::Column(_) => "unreadable_column",
        }
    }
}

/// Canonical lowercase UUID text, or `None` when `s` is not a UUID.
fn canonical_uuid(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let ok = b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        });
    ok.then(|| s.to_ascii_lowercase())
}

/// Checks metadata is an object of strings; returns it sorted (empty for `{}` or absent).
fn parse_metadata(metadata: Option<&str>) -> Result<BTreeMap<String, String>, BadRow> {
    let Some(text) = metadata.map(str::trim) else {
        return Ok(BTreeMap::new());
    };
    if text == "{}" {
        return Ok(BTreeMap::new());
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|_| BadRow::MetadataNotObject)?;
    let serde_json::Value::Object(obj) = value else {
        return Err(BadRow::MetadataNotObject);
    };
    obj.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            _ => Err(BadRow::MetadataValueNotString(k)),
        })
        .collect()
}

impl TaskSettings {
    /// Builds the task for one row. `scratch` is reused between rows to avoid allocations.
    pub fn build(&self, row: &RowText<'_>, scratch: &mut Vec<u8>) -> Result<Task, BadRow> {
        if row.event_name.is_empty() {
            return Err(BadRow::EmptyEventName);
        }
        if row.payload.len() > self.max_payload_bytes {
            return Err(BadRow::PayloadTooLarge {
                size: row.payload.len(),
                limit: self.max_payload_bytes,
            });
        }
        for (column, size) in [
            ("event_name", row.event_name.len()),
            ("metadata", row.metadata.map_or(0, str::len)),
        ] {
            if size > self.max_payload_bytes {
                return Err(BadRow::ColumnTooLarge {
                    column,
                    size,
                    limit: self.max_payload_bytes,
                });
            }
        }
        let id = canonical_uuid(row.event_id)
            .ok_or_else(|| BadRow::InvalidEventId(row.event_id.to_owned()))?;
        let row_id = row
            .id
            .map(|s| {
                s.parse::<i64>()
                    .map_err(|_| BadRow::InvalidRowId(s.to_owned()))
            })
            .transpose()?;
        let metadata = parse_metadata(row.metadata)?;
        let mut occurred_at = String::with_capacity(32);
        time::pg_timestamptz_to_rfc3339(row.created_at, &mut occurred_at)?;

        scratch.clear();
        match self.payload_format {
            PayloadFormat::Raw => scratch.extend_from_slice(row.payload.as_bytes()),
            PayloadFormat::Envelope => {
                scratch.extend_from_slice(b"{\"id\":");
                json::write_go_string(scratch, &id);
                scratch.extend_from_slice(b",\"name\":");
                json::write_go_string(scratch, row.event_name);
                scratch.extend_from_slice(b",\"payload\":");
                scratch.extend_from_slice(row.payload.as_bytes());
                if !metadata.is_empty() {
                    scratch.extend_from_slice(b",\"metadata\":");
                    json::write_go_string_map(scratch, &metadata);
                }
                scratch.extend_from_slice(b",\"occurred_at\":\"");
                scratch.extend_from_slice(occurred_at.as_bytes());
                scratch.extend_from_slice(b"\"}");
            }
        }

        let queue = self.queue_for(row.event_name).clone();
        let mut task_type = String::with_capacity(self.type_prefix.len() + row.event_name.len());
        task_type.push_str(&self.type_prefix);
        task_type.push_str(row.event_name);
        let headers: Vec<(&str, &str)> = metadata
            .iter()
            .filter(|(k, _)| TRACE_HEADERS.contains(&k.as_str()))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let mut msg = Vec::with_capacity(scratch.len() + task_type.len() + 2 * id.len() + 64);
        encode_task(
            &TaskFields {
                task_type: &task_type,
                payload: scratch,
                id: &id,
                queue: &queue,
                max_retry: self.max_retry,
                timeout_secs: self.timeout_secs,
                retention_secs: self.retention_secs,
                headers: &headers,
            },
            &mut msg,
        );
        Ok(Task {
            queue,
            id,
            msg,
            row_id,
        })
    }
}

#[cfg(test)]
mod tests;
