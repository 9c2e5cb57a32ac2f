//! The stream's order fence: each queue's script calls form a chain that Valkey applies only in
//! the order the writer issued them.
//!
//! Why: the writer pipelines many script calls (several per batch, several batches in flight).
//! When Valkey refuses one with a reply the writer retries (`OOM` while `used_memory` hovers at
//! `maxmemory`, `BUSY`, `MISCONF`, `TRYAGAIN`) and accepts the next, the refused tasks would land
//! after later ones when re-sent: out of commit order.
//!
//! How: every call of a queue carries a token of its own and its predecessor's (the queue's
//! previous call issued in the same chain). The enqueue script lands a call only if the stream's
//! field of the queue's order key holds the predecessor's token, and then leaves its own there;
//! otherwise it refuses it with `FENCED`, which the writer retries like any failed write. Each
//! stream has its own field ([`OrderChain::stream`]): relays of other outboxes writing to the
//! same queue would otherwise break each other's chains at every write (found by review: 38
//! of 40 alternating writes refused). So a refused call makes
//! every later call of its chain refuse too, and the writer re-sends them all, in order.
//!
//! A chain starts (its first call names no predecessor) only where everything earlier has
//! landed: when a writer starts, and when it re-sends everything unconfirmed after a failure
//! ([`crate::sink::Sink::restart_order`]). A call of an older chain still on its way (a reset
//! connection's last bytes) then lands only if its own chain is unbroken up to it, which means
//! every task before it landed; tokens are unique per sink and per chain, so an older chain never
//! takes a newer one's place for long: its next call is refused, or holds tasks already there.
//! Hence a task lands only after every task issued before it (the pollers' deliveries, which carry
//! no token, are the documented exception).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One script call's place in its queue's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// This call's token.
    pub token: String,
    /// The token of the queue's previous call in this chain; empty if this call starts it.
    pub prev: String,
}

impl Link {
    /// A call outside any chain (pollers, `replay`): the script neither checks nor moves the
    /// fence.
    pub fn none() -> Self {
        Self {
            token: String::new(),
            prev: String::new(),
        }
    }
}

/// Each queue's last call issued in the current chain. Cheap to clone (shared state).
#[derive(Clone)]
pub struct OrderChain {
    stream: Arc<str>,
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    /// Random per sink, so that two relays (or a restart) never issue the same token.
    nonce: String,
    /// Tokens issued so far.
    issued: u64,
    /// Each queue's last token issued since the chain (re)started.
    last: HashMap<Arc<str>, String>,
}

impl OrderChain {
    /// The chains of the stream `stream`: its field in the order keys. Relays of one stream (a
    /// slot of one database of one Postgres system) share it, and only one of them streams at a
    /// time; a leftover's calls still on their way are refused once another chain moved the
    /// field, or land in their own chain's order.
    pub fn new(stream: String) -> Self {
        Self::with_nonce(stream, format!("{:016x}", rand::random::<u64>()))
    }

    /// The stream's field in the order keys.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// As [`new`](Self::new), with the nonce given: for deterministic simulations (tokens
    /// must still be unique per chain-keeping sink).
    pub fn with_nonce(stream: String, nonce: String) -> Self {
        Self {
            stream: Arc::from(stream),
            inner: Arc::new(Mutex::new(Inner {
                nonce,
                issued: 0,
                last: HashMap::new(),
            })),
        }
    }

    /// The links of `calls` script calls of `queue`, issued now, in order.
    pub fn issue(&self, queue: &str, calls: usize) -> Vec<Link> {
        let mut inner = self.inner.lock().unwrap();
        let mut prev = inner.last.get(queue).cloned().unwrap_or_default();
        let mut links = Vec::with_capacity(calls);
        for _ in 0..calls {
            inner.issued += 1;
            let token = format!("{}.{}", inner.nonce, inner.issued);
            links.push(Link {
                token: token.clone(),
                prev: std::mem::replace(&mut prev, token),
            });
        }
        if !links.is_empty() {
            inner.last.insert(Arc::from(queue), prev);
        }
        links
    }

    /// The next call of every queue starts a chain. Only where every task issued before has
    /// landed or will never land (see the module docs).
    pub fn restart(&self) {
        self.inner.lock().unwrap().last.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_queue_chains_its_calls_in_the_order_they_are_issued() {
        let chain = OrderChain::with_nonce("s".into(), "n".into());
        let a = chain.issue("a", 2);
        let b = chain.issue("b", 1);
        let a2 = chain.issue("a", 1);
        assert_eq!(a[0].prev, "", "the first call starts the chain");
        assert_eq!(a[1].prev, a[0].token);
        assert_eq!(b[0].prev, "", "another queue has its own chain");
        assert_eq!(
            a2[0].prev, a[1].token,
            "a later batch follows the earlier one"
        );
        let mut tokens: Vec<_> = [&a[..], &b[..], &a2[..]]
            .concat()
            .into_iter()
            .map(|l| l.token)
            .collect();
        tokens.sort();
        tokens.dedup();
        assert_eq!(tokens.len(), 4, "tokens are unique");
    }

    #[test]
    fn a_restart_starts_every_chain_again_with_new_tokens() {
        let chain = OrderChain::with_nonce("s".into(), "n".into());
        let before = chain.issue("a", 1);
        chain.restart();
        let after = chain.issue("a", 1);
        assert_eq!(after[0].prev, "");
        assert_ne!(after[0].token, before[0].token);
        assert!(chain.issue("a", 0).is_empty());
        assert_eq!(chain.issue("a", 1)[0].prev, after[0].token);
    }

    #[test]
    fn two_sinks_never_issue_the_same_token() {
        let (x, y) = (OrderChain::new("s".into()), OrderChain::new("s".into()));
        assert_ne!(x.issue("a", 1)[0].token, y.issue("a", 1)[0].token);
    }
}
