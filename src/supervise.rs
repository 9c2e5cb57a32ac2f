//! The relay's main work beside its background tasks (pollers, marker, monitor, cleanup): a
//! background task that panics must not leave the relay running without it, since the rows it
//! delivers or marks would then wait for ever. [`supervise`] runs the work until it ends or a
//! background task panics; a panic cancels the work's token and becomes the relay's error.

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How the work ended under supervision.
#[derive(Debug)]
pub enum Supervised<T> {
    /// The work ended by itself (its own result), no background task having panicked.
    Ended(T),
    /// A background task panicked (its message); the work was stopped through its token and
    /// ended with this result.
    Panicked { panic: String, work: T },
}

/// Runs `work` until it ends. When a task in `background` panics first, `stop` (the work's
/// token) is cancelled and the work is awaited to its end, so that it stops as on a shutdown
/// (final acknowledgement included) rather than being dropped mid-write. Background tasks that
/// end without panicking are reaped and change nothing.
pub async fn supervise<T>(
    work: impl std::future::Future<Output = T>,
    background: &mut JoinSet<()>,
    stop: &CancellationToken,
) -> Supervised<T> {
    tokio::pin!(work);
    let mut panicked = None;
    let result = loop {
        tokio::select! {
            result = &mut work => break result,
            Some(joined) = background.join_next(), if panicked.is_none() => {
                if let Err(e) = joined {
                    if e.is_panic() {
                        let what = panic_text(e.into_panic());
                        tracing::error!(panic = %what, "a background task panicked; stopping the relay");
                        panicked = Some(what);
                        stop.cancel();
                    }
                }
            }
        }
    };
    match panicked {
        Some(panic) => Supervised::Panicked {
            panic,
            work: result,
        },
        None => Supervised::Ended(result),
    }
}

/// A panic's message, when it carried one.
fn panic_text(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Work that runs until its token is cancelled, as the stream does, and says so.
    async fn until_stopped(stop: CancellationToken) -> &'static str {
        stop.cancelled().await;
        "stopped by its token"
    }

    /// Bounds a supervision that a broken supervisor would leave running for ever.
    const PATIENCE: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn a_background_panic_stops_the_work_and_is_reported() {
        let stop = CancellationToken::new();
        let mut background = JoinSet::new();
        let quiet = CancellationToken::new();
        let q = quiet.clone();
        background.spawn(async move { q.cancelled().await });
        background.spawn(async {
            tokio::task::yield_now().await;
            panic!("the marker fell over");
        });
        let ended = tokio::time::timeout(
            PATIENCE,
            supervise(until_stopped(stop.clone()), &mut background, &stop),
        )
        .await
        .expect("the work went on running after a background task panicked");
        match ended {
            Supervised::Panicked { panic, work } => {
                assert_eq!(panic, "the marker fell over");
                assert_eq!(work, "stopped by its token");
            }
            Supervised::Ended(work) => panic!("the panic was not reported (work: {work})"),
        }
        assert!(stop.is_cancelled());
        // The task that did not panic is still there for the caller to stop.
        assert_eq!(background.len(), 1);
        quiet.cancel();
    }

    #[tokio::test]
    async fn a_formatted_panic_message_is_kept() {
        let stop = CancellationToken::new();
        let mut background = JoinSet::new();
        background.spawn(async {
            let n = 3;
            panic!("poller {n} fell over");
        });
        let ended = tokio::time::timeout(
            PATIENCE,
            supervise(until_stopped(stop.clone()), &mut background, &stop),
        )
        .await
        .expect("the work went on running after a background task panicked");
        assert!(
            matches!(&ended, Supervised::Panicked { panic, .. } if panic == "poller 3 fell over"),
            "{ended:?}"
        );
    }

    #[tokio::test]
    async fn background_tasks_that_end_quietly_change_nothing() {
        let stop = CancellationToken::new();
        let mut background = JoinSet::new();
        background.spawn(async {});
        background.spawn(async {});
        let work = async {
            // Long enough for both background tasks to have ended and been reaped.
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
            42
        };
        let ended = supervise(work, &mut background, &stop).await;
        assert!(matches!(ended, Supervised::Ended(42)), "{ended:?}");
        assert!(!stop.is_cancelled());
    }
}
