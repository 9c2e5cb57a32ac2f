//! What the operator commands that join the table and Valkey (`trace`, `replay`,
//! `reconcile`) share: their connections, the table check, the tasks Valkey refused, and their
//! error.

use crate::config::{DatabaseArgs, ValkeyArgs};
use crate::postgres::PgError;
use crate::replication::setup::{self, SetupError};
use crate::sink::{Batch, WriteOutcome};
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
    /// Nothing about the failed write may be assumed; the tasks of earlier writes exist.
    #[error(
        "valkey write failed (what was written before stays; the same command run again \
         writes the rest)"
    )]
    Sink(#[from] crate::sink::SinkError),
    /// Bad input found only once connected (an unknown queue, a range with nothing in it).
    #[error("{0}")]
    Refused(String),
    /// Valkey's answer to a write names more or fewer tasks than were written.
    #[error("valkey's answer does not account for the write: {0}")]
    Unaccounted(String),
    /// The command's report is printed; this is why it still fails.
    #[error(
        "valkey refused {count} task(s) for good (`refused` in the report); their rows are \
         unchanged (with --force their kept tasks were deleted first): mend the queue, then run \
         the same command again"
    )]
    TasksRefused { count: usize },
}

/// A task Valkey refused for good when an operator command wrote it (see
/// [`crate::sink::Rejected`]). Nothing was written for it; its row is left as it was.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RefusedTask {
    pub event_id: String,
    pub queue: String,
    pub reason: String,
}

/// The tasks of `batch` that `out` refused, once `out` is checked to answer for every task.
pub fn refused_tasks(batch: &Batch, out: &WriteOutcome) -> Result<Vec<RefusedTask>, OperatorError> {
    out.accounts_for(batch.len())
        .map_err(OperatorError::Unaccounted)?;
    Ok(out
        .rejected
        .iter()
        .map(|r| {
            let task = &batch.tasks[r.index];
            RefusedTask {
                event_id: task.id.clone(),
                queue: task.queue.to_string(),
                reason: r.reason.clone(),
            }
        })
        .collect())
}

/// The lines of a text report that name the refused tasks.
pub fn render_refused(out: &mut String, refused: &[RefusedTask]) {
    use std::fmt::Write;
    for r in refused {
        // The reason names the queue.
        let _ = writeln!(
            out,
            "refused  {}  {}",
            r.event_id,
            crate::asynq_state::one_line(&r.reason)
        );
    }
}

/// Ends a command whose report is printed: an error when Valkey refused tasks.
pub fn fail_on_refused(refused: &[RefusedTask]) -> Result<(), OperatorError> {
    match refused.len() {
        0 => Ok(()),
        count => Err(OperatorError::TasksRefused { count }),
    }
}

/// The database (its outbox table checked, with the delivery-state columns) and Valkey.
pub async fn connect(
    db: &DatabaseArgs,
    valkey: &ValkeyArgs,
) -> Result<(tokio_postgres::Client, ValkeyConnection), OperatorError> {
    let client = db.target()?.connect().await?;
    setup::check_table(&client, &db.table, false).await?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::Rejected;
    use crate::task::Task;

    fn batch(ids: &[&str]) -> Batch {
        let mut batch = Batch::default();
        for id in ids {
            batch.push(Task {
                queue: "payments".into(),
                id: (*id).into(),
                msg: Vec::new(),
                row_id: None,
            });
        }
        batch
    }

    fn refusal(index: usize) -> Rejected {
        Rejected {
            index,
            reason: "WRONGTYPE".into(),
        }
    }

    /// `replay` and `reconcile` count and list what the answer says; an answer that does not
    /// name every task of the write once (too few or too many, a refusal twice or outside the
    /// write) is an error, never a count, a report or a panic on the index.
    #[test]
    fn the_refused_tasks_of_an_answer_that_does_not_account_for_the_write_are_an_error() {
        let b = batch(&["a", "b", "c"]);
        let answer = |enqueued, duplicates, rejected| WriteOutcome {
            enqueued,
            duplicates,
            rejected,
        };
        let listed = refused_tasks(&b, &answer(1, 1, vec![refusal(2)])).unwrap();
        assert_eq!(
            listed,
            [RefusedTask {
                event_id: "c".into(),
                queue: "payments".into(),
                reason: "WRONGTYPE".into(),
            }]
        );
        assert!(refused_tasks(&b, &answer(3, 0, vec![])).unwrap().is_empty());
        for wrong in [
            answer(2, 0, vec![]),
            answer(3, 1, vec![]),
            answer(2, 0, vec![refusal(3)]),
            answer(1, 0, vec![refusal(0), refusal(0)]),
        ] {
            match refused_tasks(&b, &wrong) {
                Err(OperatorError::Unaccounted(why)) => assert!(
                    why.contains("of 3 tasks") || why.contains("the 3 tasks"),
                    "{why}"
                ),
                other => panic!("{wrong:?}: {other:?}"),
            }
        }
    }
}
