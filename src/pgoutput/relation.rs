//! Relation messages and the per-stream cache of table definitions they build.

use super::reader::Reader;
use super::DecodeError;
use std::collections::HashMap;
use std::fmt;

/// The outbox columns the relay reads, by name. Their position in a tuple comes from the newest
/// Relation message, never from an assumed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutboxColumn {
    Id = 0,
    EventId = 1,
    EventName = 2,
    Payload = 3,
    Metadata = 4,
    CreatedAt = 5,
}

impl OutboxColumn {
    pub const COUNT: usize = 6;
    pub const ALL: [OutboxColumn; Self::COUNT] = [
        OutboxColumn::Id,
        OutboxColumn::EventId,
        OutboxColumn::EventName,
        OutboxColumn::Payload,
        OutboxColumn::Metadata,
        OutboxColumn::CreatedAt,
    ];

    /// The column name in the Go kit's table.
    pub fn name(self) -> &'static str {
        match self {
            OutboxColumn::Id => "id",
            OutboxColumn::EventId => "event_id",
            OutboxColumn::EventName => "event_name",
            OutboxColumn::Payload => "payload",
            OutboxColumn::Metadata => "metadata",
            OutboxColumn::CreatedAt => "created_at",
        }
    }

    /// Columns a task cannot be built without (`id` and `metadata` are optional).
    pub fn required(self) -> bool {
        !matches!(self, OutboxColumn::Id | OutboxColumn::Metadata)
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }
}

impl fmt::Display for OutboxColumn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which table is the outbox: `schema.table`, or a bare table name that matches any schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    pub schema: Option<String>,
    pub table: String,
}

impl TableName {
    /// Parses `table` or `schema.table` (unquoted identifiers).
    pub fn parse(s: &str) -> Option<Self> {
        let ident = |p: &str| {
            let mut chars = p.chars();
            matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
                && chars
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '$')
                && p.len() <= 63
        };
        match s.split_once('.') {
            Some((schema, table)) if ident(schema) && ident(table) => Some(Self {
                schema: Some(schema.to_owned()),
                table: table.to_owned(),
            }),
            None if ident(s) => Some(Self {
                schema: None,
                table: s.to_owned(),
            }),
            _ => None,
        }
    }

    fn matches(&self, namespace: &str, name: &str) -> bool {
        name == self.table && self.schema.as_deref().is_none_or(|s| s == namespace)
    }

    /// The name as SQL text (`schema.table` or `table`); identifiers are validated on parse.
    pub fn sql(&self) -> String {
        match &self.schema {
            Some(s) => format!("{s}.{}", self.table),
            None => self.table.clone(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.sql())
    }
}

/// Where each outbox column sits in this relation's tuples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnMap {
    /// Tuple position -> outbox column (None for columns the relay does not read).
    by_position: Vec<Option<OutboxColumn>>,
    /// Required columns this table definition lacks: every row of it is a bad row.
    missing: Vec<OutboxColumn>,
}

impl ColumnMap {
    pub(super) fn column_at(&self, position: usize) -> Option<OutboxColumn> {
        self.by_position.get(position).copied().flatten()
    }

    /// Required columns missing from the table definition.
    pub fn missing(&self) -> &[OutboxColumn] {
        &self.missing
    }
}

/// One table definition from a Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<String>,
    /// Set when this relation is the configured outbox table.
    outbox: Option<ColumnMap>,
}

impl Relation {
    pub fn outbox_map(&self) -> Option<&ColumnMap> {
        self.outbox.as_ref()
    }
}

pub(super) fn parse_relation(r: &mut Reader<'_>) -> Result<Relation, DecodeError> {
    let id = r.u32()?;
    let namespace = r.cstr()?.to_owned();
    let name = r.cstr()?.to_owned();
    let _replica_identity = r.u8()?;
    let ncols = r.i16_len()?;
    let mut columns = Vec::with_capacity(ncols.min(1600));
    for _ in 0..ncols {
        let _flags = r.u8()?;
        columns.push(r.cstr()?.to_owned());
        let _type_oid = r.u32()?;
        let _type_modifier = r.i32()?;
    }
    Ok(Relation {
        id,
        namespace,
        name,
        columns,
        outbox: None,
    })
}

/// Table definitions seen on this stream, by relation id. A new Relation message replaces the
/// old definition (ALTER TABLE while streaming).
#[derive(Debug)]
pub struct RelationCache {
    outbox: TableName,
    relations: HashMap<u32, Relation>,
}

impl RelationCache {
    pub fn new(outbox: TableName) -> Self {
        Self {
            outbox,
            relations: HashMap::new(),
        }
    }

    pub(super) fn insert(&mut self, mut rel: Relation) {
        if self.outbox.matches(&rel.namespace, &rel.name) {
            let by_position: Vec<_> = rel
                .columns
                .iter()
                .map(|c| OutboxColumn::from_name(c))
                .collect();
            let missing = OutboxColumn::ALL
                .into_iter()
                .filter(|c| c.required() && !by_position.contains(&Some(*c)))
                .collect();
            rel.outbox = Some(ColumnMap {
                by_position,
                missing,
            });
        }
        self.relations.insert(rel.id, rel);
    }

    pub fn get(&self, id: u32) -> Option<&Relation> {
        self.relations.get(&id)
    }
}
