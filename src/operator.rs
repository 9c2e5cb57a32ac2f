//! What the operator commands that join the table and Valkey (`trace`, `replay`,
//! `reconcile`) share: their connections, the table check, and their error.

use crate::config::{DatabaseArgs, ValkeyArgs};
use crate::postgres::PgError;
use crate::replication::setup::{self, SetupError};
use crate::valkey::ValkeyConnection;

/// Why an operator command failed.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Connect(#[from] PgError),
    #[error(transparent)]
    Table(#[from] SetupError),
    #[error("postgres query failed")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("cannot reach Valkey at {target}")]
    ValkeyConnect {
        target: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("valkey command failed")]
    Valkey(#[from] redis::RedisError),
    #[error("valkey write failed")]
    Sink(#[from] crate::sink::SinkError),
    /// Bad input found only once connected (an unknown queue, a range with nothing in it).
    #[error("{0}")]
    Refused(String),
}

/// The database (its outbox table checked, with the delivery-state columns) and Valkey.
pub async fn connect(
    db: &DatabaseArgs,
    valkey: &ValkeyArgs,
) -> Result<(tokio_postgres::Client, ValkeyConnection), OperatorError> {
    let client = db.target()?.connect().await?;
    setup::check_table(&client, &db.table).await?;
    setup::check_poller_columns(&client, &db.table).await?;
    let conn = valkey
        .target()?
        .connect()
        .await
        .map_err(|source| OperatorError::ValkeyConnect {
            target: valkey.display(),
            source,
        })?;
    Ok((client, conn))
}
