//! [`OutboxTable`] and [`OutboxTx`] on a deadpool-postgres pool.

use super::{ClaimedRow, OutboxTable, OutboxTx, Store, StoreError};
use std::time::Duration;

/// The outbox table through a connection pool.
#[derive(Clone)]
pub struct PgOutbox {
    pub pool: deadpool_postgres::Pool,
    pub store: Store,
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
        tx.client().batch_execute("BEGIN").await?;
        Ok(tx)
    }
}

impl OutboxTx for PgTx {
    async fn claim(
        &mut self,
        limit: usize,
        older_than: Option<Duration>,
    ) -> Result<Vec<ClaimedRow>, StoreError> {
        Ok(self
            .store
            .claim(&***self.client(), limit, older_than)
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
