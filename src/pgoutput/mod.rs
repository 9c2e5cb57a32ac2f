//! Pure `pgoutput` (protocol version 1) decoding: bytes plus a relation cache in, outbox rows out.
//!
//! This module owns the wire format of the logical replication payloads that arrive inside
//! `XLogData` and nothing else: no I/O, no async, no allocation per row beyond the relation
//! cache. Every read checks its length first and every failure is a [`DecodeError`]; no input
//! makes it panic (a property test and a fuzz target keep that true).
//!
//! Columns are mapped by NAME from each Relation message, so extra columns, any column order
//! and an `ALTER TABLE` while streaming all work: Postgres sends a fresh Relation message
//! before the first change that uses a new table definition.

mod reader;
mod relation;

pub use relation::{ColumnMap, OutboxColumn, Relation, RelationCache, TableName};

use reader::Reader;
use std::ops::Range;

/// Message tags of pgoutput protocol version 1 (see the PostgreSQL docs, "Logical Replication
/// Message Formats").
pub mod tag {
    pub const BEGIN: u8 = b'B';
    pub const COMMIT: u8 = b'C';
    pub const ORIGIN: u8 = b'O';
    pub const RELATION: u8 = b'R';
    pub const TYPE: u8 = b'Y';
    pub const INSERT: u8 = b'I';
    pub const UPDATE: u8 = b'U';
    pub const DELETE: u8 = b'D';
    pub const TRUNCATE: u8 = b'T';
    pub const MESSAGE: u8 = b'M';
}

/// Why a payload could not be decoded. The stream treats every variant as a protocol fault.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message is empty")]
    Empty,
    #[error("message truncated: needed {needed} more bytes at offset {offset}")]
    Truncated { offset: usize, needed: usize },
    #[error("unterminated string at offset {offset}")]
    UnterminatedString { offset: usize },
    #[error("string at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: usize },
    #[error("negative length {len} at offset {offset}")]
    NegativeLength { offset: usize, len: i64 },
    #[error("unknown message tag 0x{0:02x}")]
    UnknownTag(u8),
    #[error("unknown tuple column kind 0x{kind:02x} at offset {offset}")]
    UnknownColumnKind { offset: usize, kind: u8 },
    #[error("insert tuple marker is 0x{0:02x}, expected 'N'")]
    BadTupleMarker(u8),
    #[error("insert for relation {0} that was never described by a Relation message")]
    UnknownRelation(u32),
    #[error("{trailing} trailing bytes after a complete message")]
    TrailingBytes { trailing: usize },
}

/// One column value of a decoded tuple, as a byte range into the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    /// An unchanged TOASTed value: never sent for an INSERT, so a bad row if seen.
    Unchanged,
    Text(Range<usize>),
    Binary(Range<usize>),
}

/// An INSERT into the outbox table, with the columns the relay needs picked out by name.
/// Borrows the message bytes: nothing is copied until the task is encoded.
#[derive(Debug)]
pub struct OutboxInsert<'a> {
    data: &'a [u8],
    values: [Option<Value>; OutboxColumn::COUNT],
}

impl<'a> OutboxInsert<'a> {
    /// The text of a column, `Ok(None)` when it is SQL NULL or the table has no such column.
    pub fn text(&self, col: OutboxColumn) -> Result<Option<&'a str>, RowError> {
        match &self.values[col as usize] {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Text(r)) => std::str::from_utf8(&self.data[r.clone()])
                .map(Some)
                .map_err(|_| RowError::NotUtf8(col)),
            Some(Value::Binary(_)) => Err(RowError::Binary(col)),
            Some(Value::Unchanged) => Err(RowError::Unchanged(col)),
        }
    }
}

/// A column value the relay cannot use (the row is bad, the stream is fine).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RowError {
    #[error("column {0} is not valid UTF-8 text")]
    NotUtf8(OutboxColumn),
    #[error("column {0} arrived in binary format")]
    Binary(OutboxColumn),
    #[error("column {0} arrived as an unchanged TOAST placeholder")]
    Unchanged(OutboxColumn),
}

/// What one pgoutput payload means to the relay.
#[derive(Debug)]
pub enum Decoded<'a> {
    /// A Relation message was stored in the cache (a table definition, maybe new).
    Relation { relation_id: u32 },
    /// An INSERT into the configured outbox table.
    Insert(OutboxInsert<'a>),
    /// An INSERT into some other table of the publication: ignored.
    OtherInsert { relation_id: u32 },
    /// A message the relay ignores on purpose: UPDATE, DELETE, TRUNCATE, Type, Origin, and
    /// Begin/Commit/Message (which the transport already turned into events).
    Ignored(u8),
}

/// Decodes one pgoutput payload. Relation messages update `cache`; inserts are resolved against
/// it. Never panics; every malformed input is an error.
pub fn decode<'a>(data: &'a [u8], cache: &mut RelationCache) -> Result<Decoded<'a>, DecodeError> {
    let mut r = Reader::new(data);
    let tag = r.u8().map_err(|_| DecodeError::Empty)?;
    match tag {
        tag::RELATION => {
            let rel = relation::parse_relation(&mut r)?;
            r.finish()?;
            let relation_id = rel.id;
            cache.insert(rel);
            Ok(Decoded::Relation { relation_id })
        }
        tag::INSERT => decode_insert(data, r, cache),
        tag::UPDATE
        | tag::DELETE
        | tag::TRUNCATE
        | tag::TYPE
        | tag::ORIGIN
        | tag::BEGIN
        | tag::COMMIT
        | tag::MESSAGE => Ok(Decoded::Ignored(tag)),
        other => Err(DecodeError::UnknownTag(other)),
    }
}

fn decode_insert<'a>(
    data: &'a [u8],
    mut r: Reader<'a>,
    cache: &RelationCache,
) -> Result<Decoded<'a>, DecodeError> {
    let relation_id = r.u32()?;
    let marker = r.u8()?;
    if marker != b'N' {
        return Err(DecodeError::BadTupleMarker(marker));
    }
    let rel = cache
        .get(relation_id)
        .ok_or(DecodeError::UnknownRelation(relation_id))?;
    let map = match rel.outbox_map() {
        Some(map) => map,
        None => {
            skip_tuple(&mut r)?;
            r.finish()?;
            return Ok(Decoded::OtherInsert { relation_id });
        }
    };
    let mut values: [Option<Value>; OutboxColumn::COUNT] = Default::default();
    let ncols = r.i16_len()?;
    for i in 0..ncols {
        let v = read_value(&mut r)?;
        if let Some(col) = map.column_at(i) {
            values[col as usize] = Some(v);
        }
    }
    r.finish()?;
    Ok(Decoded::Insert(OutboxInsert { data, values }))
}

fn skip_tuple(r: &mut Reader<'_>) -> Result<(), DecodeError> {
    let ncols = r.i16_len()?;
    for _ in 0..ncols {
        read_value(r)?;
    }
    Ok(())
}

fn read_value(r: &mut Reader<'_>) -> Result<Value, DecodeError> {
    let offset = r.offset();
    match r.u8()? {
        b'n' => Ok(Value::Null),
        b'u' => Ok(Value::Unchanged),
        b't' => Ok(Value::Text(r.len_prefixed()?)),
        b'b' => Ok(Value::Binary(r.len_prefixed()?)),
        kind => Err(DecodeError::UnknownColumnKind { offset, kind }),
    }
}

#[cfg(test)]
mod tests;
