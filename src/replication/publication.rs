//! A publication dropped (and perhaps recreated) while the slot still has WAL to decode from
//! before that.
//!
//! Postgres decodes each WAL position with the catalog as it was at that position. From the
//! drop on, the slot's walsender looks the publication up by name in that historic catalog,
//! finds nothing, and ends the stream with `publication "x" does not exist` (SQLSTATE 42704)
//! at the first change it decodes. A new publication of the same name does not help: it is
//! another object, created later in the WAL. Reconnecting resumes from the slot's confirmed
//! position, before the drop, and fails at the same place: forever, and across restarts.
//!
//! The way out is the one for a lost slot: a new slot, which starts at the current WAL position
//! and with the current catalog. Events committed between the slot's confirmed position and
//! the new slot's start are not lost: their rows stay unpublished in the table, and the
//! recovery poller delivers them (asynq's TaskID dedupe absorbs any the stream had sent).
//!
//! This file holds the classification (PURE) and the SQL of the repair; the stream's
//! supervisor calls them.

use super::setup::{self, SetupError, SlotInfo};
use crate::pgoutput::TableName;
use tokio_postgres::Client;

/// Whether a walsender error says that `publication` does not exist in the catalog it decodes
/// with. SQLSTATE 42704 alone is not enough (a missing slot is 42704 too): the message must
/// name the publication.
pub fn is_missing_error(server_error: &str, publication: &str) -> bool {
    server_error.contains("SQLSTATE 42704")
        && server_error.contains(&format!("publication \"{publication}\" does not exist"))
}

/// The publication as the current catalog has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicationNow {
    /// Its oid; `None` when it does not exist (dropped and not recreated).
    pub oid: Option<u32>,
}

/// Looks the publication up now.
pub async fn current(client: &Client, publication: &str) -> Result<PublicationNow, SetupError> {
    let row = client
        .query_opt(
            "SELECT oid FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?;
    Ok(PublicationNow {
        oid: row.map(|r| r.get::<_, u32>(0)),
    })
}

/// Repairs a slot that cannot decode past a publication's drop: the publication is created
/// again if it is still missing (inserts of `table` only, as at start-up), then the slot is
/// dropped and created afresh. Returns the new slot, and the publication as it was found.
pub async fn recreate_slot(
    client: &Client,
    slot: &str,
    publication: &str,
    table: &TableName,
) -> Result<(SlotInfo, PublicationNow), SetupError> {
    let found = current(client, publication).await?;
    // Creates it when missing; checks that it publishes the table's inserts otherwise.
    setup::ensure_publication(client, publication, table).await?;
    setup::drop_slot(client, slot).await?;
    let info = setup::ensure_slot(client, slot).await?;
    Ok((info, found))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_missing_publication_of_the_relay_matches() {
        let pg = "publication \"outbox_relay\" does not exist (SQLSTATE 42704)";
        assert!(is_missing_error(pg, "outbox_relay"));
        assert!(!is_missing_error(pg, "other"));
        let slot = "replication slot \"s\" does not exist (SQLSTATE 42704)";
        assert!(!is_missing_error(slot, "outbox_relay"));
        let other_state = "publication \"outbox_relay\" does not exist (SQLSTATE XX000)";
        assert!(!is_missing_error(other_state, "outbox_relay"));
    }
}
