//! The properties the fuzz targets check, shared by two drivers: libFuzzer through `cargo fuzz`
//! (fuzz/fuzz_targets/, nightly) and `tests/fuzz_targets.rs`, which runs them on generated and
//! mutated inputs on the stable toolchain in every test run.

use outbox_relay::pgoutput::{decode, Decoded, OutboxColumn, RelationCache, TableName};
use outbox_relay::task::{RowText, TaskMessage, TaskSettings};
use prost::Message;

/// The outbox table's columns, in the Go kit's migration order.
pub const COLUMNS: [&str; 7] = [
    "id",
    "event_id",
    "event_name",
    "payload",
    "metadata",
    "created_at",
    "published_at",
];

/// A Relation message for `public.outbox_events` (relation id 7, every column text).
pub fn relation() -> Vec<u8> {
    let mut m = vec![b'R', 0, 0, 0, 7];
    m.extend_from_slice(b"public\0outbox_events\0d");
    m.extend_from_slice(&(COLUMNS.len() as i16).to_be_bytes());
    for c in COLUMNS {
        m.push(0);
        m.extend_from_slice(c.as_bytes());
        m.push(0);
        m.extend_from_slice(&25u32.to_be_bytes());
        m.extend_from_slice(&(-1i32).to_be_bytes());
    }
    m
}

/// Arbitrary bytes into the pgoutput decoder, after a valid Relation of the outbox table (so
/// inserts reach the column mapping): it must never panic, and every decoded insert's columns
/// must be readable. The input may hold several messages separated by the byte 0xfe. Returns
/// how many inserts decoded.
pub fn decode_target(data: &[u8]) -> usize {
    let mut inserts = 0;
    let mut cache = RelationCache::new(TableName::parse("outbox_events").unwrap());
    decode(&relation(), &mut cache).unwrap();
    for part in data.split(|b| *b == 0xfe) {
        if let Ok(Decoded::Insert(row)) = decode(part, &mut cache) {
            inserts += 1;
            for col in OutboxColumn::ALL {
                let _ = row.text(col);
            }
        }
    }
    inserts
}

/// Arbitrary column text into the task builder (event_id, event_name, payload, metadata and
/// created_at, separated by U+0001): it must never panic, and whatever it accepts must decode
/// back as a TaskMessage whose id is the event id. Returns whether it became a task.
pub fn task_target(data: &[u8]) -> bool {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(5, '\u{1}');
    let (Some(event_id), Some(name), Some(payload), Some(metadata), Some(created)) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return false;
    };
    let settings = TaskSettings::default();
    let row = RowText {
        id: None,
        event_id,
        event_name: name,
        payload,
        metadata: Some(metadata),
        created_at: created,
    };
    match settings.build(&row, &mut Vec::new()) {
        Ok(task) => {
            assert!(TaskMessage::decode(task.msg.as_slice()).is_ok());
            assert_eq!(task.id, event_id.to_ascii_lowercase());
            true
        }
        Err(_) => false,
    }
}
