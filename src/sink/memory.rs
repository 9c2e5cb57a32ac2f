//! An in-memory sink for tests: asynq's dedupe semantics (a TaskID is written once) and
//! failures on demand.

use super::{Batch, Sink, SinkError, WriteOutcome};
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
struct State {
    ids: HashSet<String>,
    /// TaskIDs in the order they were first written, per queue: (queue, id).
    order: Vec<(String, String)>,
}

/// Clones share one store.
#[derive(Debug, Clone, Default)]
pub struct MemorySink {
    state: Arc<Mutex<State>>,
    fail_next: Arc<AtomicUsize>,
}

impl MemorySink {
    /// The next `n` writes fail without writing anything.
    pub fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// TaskIDs in first-write order.
    pub fn ids(&self) -> Vec<String> {
        let st = self.state.lock().expect("memory sink lock");
        st.order.iter().map(|(_, id)| id.clone()).collect()
    }
}

impl Sink for MemorySink {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static {
        let this = self.clone();
        async move {
            let failed = this
                .fail_next
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if failed {
                return Err(SinkError::Injected);
            }
            let mut st = this.state.lock().expect("memory sink lock");
            let mut out = WriteOutcome::default();
            for t in &batch.tasks {
                if st.ids.insert(t.id.clone()) {
                    st.order.push((t.queue.to_string(), t.id.clone()));
                    out.enqueued += 1;
                } else {
                    out.duplicates += 1;
                }
            }
            Ok(out)
        }
    }
}
