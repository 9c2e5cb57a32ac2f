//! Arbitrary bytes into the pgoutput decoder, after a valid Relation of the outbox table (so
//! inserts reach the column mapping): it must never panic, and every decoded insert's columns
//! must be readable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use outbox_relay::pgoutput::{decode, Decoded, OutboxColumn, RelationCache, TableName};

fn relation() -> Vec<u8> {
    let mut m = vec![b'R', 0, 0, 0, 7];
    m.extend_from_slice(b"public\0outbox_events\0d");
    let cols = ["id", "event_id", "event_name", "payload", "metadata", "created_at", "published_at"];
    m.extend_from_slice(&(cols.len() as i16).to_be_bytes());
    for c in cols {
        m.push(0);
        m.extend_from_slice(c.as_bytes());
        m.push(0);
        m.extend_from_slice(&25u32.to_be_bytes());
        m.extend_from_slice(&(-1i32).to_be_bytes());
    }
    m
}

fuzz_target!(|data: &[u8]| {
    let mut cache = RelationCache::new(TableName::parse("outbox_events").unwrap());
    decode(&relation(), &mut cache).unwrap();
    // The input may hold several messages separated by a marker byte sequence.
    for part in data.split(|b| *b == 0xfe) {
        if let Ok(Decoded::Insert(row)) = decode(part, &mut cache) {
            for col in OutboxColumn::ALL {
                let _ = row.text(col);
            }
        }
    }
});
