//! pgoutput messages as Postgres sends them, for the simulated walsender: the real decoder reads
//! them, unchanged.

/// The outbox's columns, in the Go kit's order.
pub const COLUMNS: [&str; 7] = [
    "id",
    "event_id",
    "event_name",
    "payload",
    "metadata",
    "created_at",
    "published_at",
];

/// A Relation message for `schema.name` with text columns.
pub fn relation(id: u32, schema: &str, name: &str) -> Vec<u8> {
    let mut m = vec![b'R'];
    m.extend_from_slice(&id.to_be_bytes());
    for s in [schema, name] {
        m.extend_from_slice(s.as_bytes());
        m.push(0);
    }
    m.push(b'd');
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

/// An Insert message whose columns are text, or NULL for `None`.
pub fn insert(relation: u32, values: &[Option<&str>]) -> Vec<u8> {
    let mut m = vec![b'I'];
    m.extend_from_slice(&relation.to_be_bytes());
    m.push(b'N');
    m.extend_from_slice(&(values.len() as i16).to_be_bytes());
    for v in values {
        match v {
            None => m.push(b'n'),
            Some(s) => {
                m.push(b't');
                m.extend_from_slice(&(s.len() as i32).to_be_bytes());
                m.extend_from_slice(s.as_bytes());
            }
        }
    }
    m
}
