//! [`OutboxTable`] and [`OutboxTx`] on a deadpool-postgres pool.

use super::{Claimed, OutboxTable, OutboxTx, Store, StoreError};
use std::time::Duration;

/// The outbox table through a connection pool.
#[derive(Clone)]
pub struct PgOutbox {
    pub pool: deadpool_postgres::Pool,
    pub store: Store,
    /// Set on the server for each transaction ([`OutboxTable::begin`]), so that the server ends
    /// one whose client is cut off, and its row locks go; `None`: the server's settings.
    pub tx_limits: Option<TxLimits>,
}

/// Server-side limits of a poll transaction, set with `SET LOCAL` (any role may): without them a
/// transaction whose client vanished in a partition keeps its row locks until the server's TCP
/// keepalive ends the session (two hours by Linux's defaults), or for ever when something still
/// acknowledges its packets (a proxy, a NAT box); other pollers skip the locked rows and the
/// marker's UPDATE waits behind them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxLimits {
    /// `idle_in_transaction_session_timeout`: the transaction idle this long between statements
    /// ends the session (longer than any wait of a round, see
    /// [`crate::poller::PollerSettings::idle_in_transaction_bound`]).
    pub idle: Duration,
    /// `tcp_user_timeout`: data the server sent unacknowledged this long ends the session (a
    /// server blocked sending a claimed batch to a client that is gone is not idle).
    pub unacknowledged: Duration,
}

impl TxLimits {
    /// The statements that begin a transaction under these limits (one round trip).
    pub fn begin_sql(&self) -> String {
        format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}; \
             SET LOCAL tcp_user_timeout = {}",
            millis(self.idle),
            millis(self.unacknowledged)
        )
    }
}

/// Whole milliseconds, at least 1 (0 turns either setting off).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A transaction on a pooled connection. Dropped before commit, the connection is taken out of
/// the pool and closed, which rolls the transaction back and releases its row locks.
pub struct PgTx {
    client: Option<deadpool_postgres::Object>,
    store: Store,
}

impl PgTx {
    fn client(&self) -> &deadpool_postgres::Object {
        self.client.as_ref().expect("used after commit")
    }
}

impl Drop for PgTx {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

impl OutboxTable for PgOutbox {
    type Tx = PgTx;

    async fn mark_published(&self, rows: &[(i64, uuid::Uuid)]) -> Result<Vec<i64>, StoreError> {
        let client = self.pool.get().await?;
        Ok(self.store.mark_delivered_returning(&**client, rows).await?)
    }

    async fn begin(&self) -> Result<PgTx, StoreError> {
        let client = self.pool.get().await?;
        let tx = PgTx {
            client: Some(client),
            store: self.store.clone(),
        };
        match &self.tx_limits {
            Some(limits) => tx.client().batch_execute(&limits.begin_sql()).await?,
            None => tx.client().batch_execute("BEGIN").await?,
        }
        Ok(tx)
    }
}

impl OutboxTx for PgTx {
    async fn claim(
        &mut self,
        limit: usize,
        bytes: usize,
        older_than: Option<Duration>,
    ) -> Result<Claimed, StoreError> {
        Ok(self
            .store
            .claim(&***self.client(), limit, bytes, older_than)
            .await?)
    }

    async fn mark_failed(
        &mut self,
        id: i64,
        error: &str,
        backoff: Duration,
        max_attempts: i32,
    ) -> Result<bool, StoreError> {
        Ok(self
            .store
            .mark_failed(&***self.client(), id, error, backoff, max_attempts)
            .await?)
    }

    async fn mark_published(&mut self, ids: &[i64]) -> Result<(), StoreError> {
        self.store.mark_published(&***self.client(), ids).await?;
        Ok(())
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        let client = self.client.take().expect("committed once");
        if let Err(e) = client.batch_execute("COMMIT").await {
            // The connection's state is unknown: do not hand it to the next user.
            drop(deadpool_postgres::Object::take(client));
            return Err(e.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limits_are_set_for_the_transaction_only_in_milliseconds() {
        let limits = TxLimits {
            idle: Duration::from_secs(9),
            unacknowledged: Duration::from_micros(10),
        };
        assert_eq!(
            limits.begin_sql(),
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = 9000; \
             SET LOCAL tcp_user_timeout = 1"
        );
    }
}
