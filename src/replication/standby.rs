//! Decoding on a standby (PostgreSQL 16+, `OUTBOX_REPLICATION_URL`): the slot lives on a hot
//! standby and the stream reads from it, so the primary spends no CPU on decoding; the SQL
//! connections (setup, poller, marking) still go to the primary.
//!
//! A standby creates a logical slot only once it has replayed a snapshot of the primary's
//! running transactions, which the primary writes every 15 s or so when busy, and not at all when
//! idle. While the slot is being created the primary is asked for one every half second
//! (`pg_log_standby_snapshot()`), so creation takes about as long as the standby's replay lag.

use super::setup::{self, SetupError, SlotInfo};
use crate::config::ConfigError;
use crate::postgres::{PgError, PgTarget};
use std::time::Duration;
use tokio_postgres::Client;

/// The setting's name, for errors.
pub const SETTING: &str = "OUTBOX_REPLICATION_URL";

#[derive(Debug, thiserror::Error)]
pub enum StandbyError {
    #[error(
        "{SETTING} points to PostgreSQL {0}, which cannot decode on a standby: that needs \
         PostgreSQL 16 or later (or leave {SETTING} unset to stream from the primary)"
    )]
    TooOld(String),
    #[error(
        "the standby has not replayed publication {publication:?} within {waited_secs} s of its \
         creation on the primary (replication lag?); trying again"
    )]
    PublicationNotReplayed {
        publication: String,
        waited_secs: u64,
    },
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Postgres(#[from] PgError),
}

impl StandbyError {
    /// Worth another try: the server or the link, or a standby still catching up.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StandbyError::Postgres(_)
                | StandbyError::Setup(SetupError::Query(_))
                | StandbyError::PublicationNotReplayed { .. }
        )
    }
}

/// How long [`recreate_slot`] waits for the standby to replay the publication.
const PUBLICATION_REPLAY_WAIT: Duration = Duration::from_secs(30);

/// The replication target: `url` parsed, or the error naming the setting.
pub fn target(url: &str) -> Result<PgTarget, ConfigError> {
    PgTarget::parse(url).map_err(|e| ConfigError::Invalid {
        setting: SETTING.into(),
        reason: e.to_string(),
    })
}

/// Checks the server of `replication` (a standby of 16+, or any primary) and creates the slot
/// there when missing, nudging `primary` for the snapshot a standby waits for.
pub async fn ensure_slot(
    primary: &Client,
    replication: &PgTarget,
    slot: &str,
) -> Result<SlotInfo, StandbyError> {
    let client = replication.connect().await?;
    let row = client
        .query_one(
            "SELECT current_setting('server_version_num')::int, current_setting('server_version'), pg_is_in_recovery()",
            &[],
        )
        .await
        .map_err(SetupError::from)?;
    let (version_num, version, in_recovery): (i32, String, bool) =
        (row.get(0), row.get(1), row.get(2));
    if !in_recovery {
        // A primary (perhaps a promoted standby): nothing special.
        setup::check_wal_level(&client).await?;
        return Ok(setup::ensure_slot(&client, slot).await?);
    }
    if version_num < 160000 {
        return Err(StandbyError::TooOld(version));
    }
    setup::check_wal_level(&client).await?;
    if let Some(info) = setup::slot_info(&client, slot).await? {
        return Ok(info);
    }
    tracing::info!(
        slot,
        target_db = %replication.display(),
        "creating the slot on the standby (waits for a snapshot from the primary)"
    );
    let create = setup::ensure_slot(&client, slot);
    tokio::pin!(create);
    let mut nudge = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            created = &mut create => return Ok(created?),
            _ = nudge.tick() => {
                if let Err(e) = primary.execute("SELECT pg_log_standby_snapshot()", &[]).await {
                    tracing::debug!(error = %e, "pg_log_standby_snapshot() failed on the primary");
                }
            }
        }
    }
}

/// Drops the slot on the standby and creates it again, as `recreate_slot` in
/// [`super::publication`] does on a primary; a missing publication is created on the primary
/// (a standby is read-only), and the slot only once the standby has replayed it, so that the
/// new slot decodes from a position where the publication exists.
pub async fn recreate_slot(
    primary: &PgTarget,
    replication: &PgTarget,
    slot: &str,
    publication: &str,
    table: &crate::pgoutput::TableName,
) -> Result<SlotInfo, StandbyError> {
    let primary_client = primary.connect().await?;
    setup::restore_publication(&primary_client, publication, table).await?;
    let client = replication.connect().await?;
    let started = tokio::time::Instant::now();
    loop {
        let replayed = client
            .query_opt(
                "SELECT 1 FROM pg_publication WHERE pubname = $1",
                &[&publication],
            )
            .await
            .map_err(SetupError::from)?
            .is_some();
        if replayed {
            break;
        }
        if started.elapsed() >= PUBLICATION_REPLAY_WAIT {
            return Err(StandbyError::PublicationNotReplayed {
                publication: publication.to_owned(),
                waited_secs: PUBLICATION_REPLAY_WAIT.as_secs(),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    setup::drop_slot(&client, slot).await?;
    ensure_slot(&primary_client, replication, slot).await
}
