//! The invariant checker of the fault suite: a producer load of mixed transaction sizes (some
//! rolled back) that records what it committed, in commit order, and a verdict comparing the
//! committed `event_id`s with the asynq tasks in Valkey: zero missing, zero ids pushed twice to a
//! pending list, zero tasks from rolled-back transactions, first occurrences in the pending list
//! in commit order, and the replays the relay saw (its `outbox_events_duplicate_total`: tasks
//! re-sent whose TaskID already existed), so a scenario that must replay can assert it did.

use super::{connect, pending_ids, Redis, PATIENCE};
use rand::Rng;
use std::collections::HashSet;
use std::fmt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The shape of the load.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Transaction sizes, picked at random per transaction.
    pub txn_sizes: Vec<usize>,
    /// One transaction in this many is rolled back.
    pub rollback_one_in: u32,
    /// Pause between transactions.
    pub pause: Duration,
}

impl Default for LoadSpec {
    fn default() -> Self {
        Self {
            txn_sizes: vec![1, 1, 1, 5, 20, 100],
            rollback_one_in: 10,
            pause: Duration::from_millis(5),
        }
    }
}

/// What the producer did.
#[derive(Debug, Default)]
pub struct LoadResult {
    /// Committed ids in commit order (transaction by transaction, rows in insert order).
    pub committed: Vec<String>,
    pub rolled_back: Vec<String>,
    /// Commits whose outcome the producer could not see (connection lost during COMMIT),
    /// resolved against the table afterwards.
    pub uncertain: Vec<String>,
    pub transactions: usize,
    /// Every id whose COMMIT was sent (committed or uncertain), in the order sent: the commit
    /// order of those that committed.
    sent: Vec<String>,
}

/// A running producer.
pub struct Load {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<LoadResult>,
    url: String,
}

impl Load {
    pub fn start(url: &str, spec: LoadSpec) -> Self {
        let stop = CancellationToken::new();
        let (u, s) = (url.to_owned(), stop.clone());
        let handle = tokio::spawn(async move { produce(u, spec, s).await });
        Self {
            stop,
            handle,
            url: url.to_owned(),
        }
    }

    /// Stops producing and resolves uncertain commits against the table.
    pub async fn stop(self) -> LoadResult {
        self.stop.cancel();
        let mut result = self.handle.await.unwrap();
        if !result.uncertain.is_empty() {
            let client = connect(&self.url).await;
            let rows = client
                .query(
                    "SELECT event_id::text FROM outbox_events WHERE event_id::text = ANY($1)",
                    &[&result.uncertain],
                )
                .await
                .unwrap();
            let found: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
            let uncertain: HashSet<String> =
                std::mem::take(&mut result.uncertain).into_iter().collect();
            result
                .rolled_back
                .extend(uncertain.iter().filter(|id| !found.contains(*id)).cloned());
            // Back into commit order, the uncertain commits that happened among the others.
            result.committed = std::mem::take(&mut result.sent)
                .into_iter()
                .filter(|id| !uncertain.contains(id) || found.contains(id))
                .collect();
        }
        result
    }
}

async fn try_connect(url: &str) -> Option<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(client)
}

async fn produce(url: String, spec: LoadSpec, stop: CancellationToken) -> LoadResult {
    let mut out = LoadResult::default();
    let mut client: Option<tokio_postgres::Client> = None;
    while !stop.is_cancelled() {
        let Some(c) = client.as_mut() else {
            client = try_connect(&url).await;
            if client.is_none() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            continue;
        };
        let (size, rollback) = {
            let mut rng = rand::rng();
            let size = spec.txn_sizes[rng.random_range(0..spec.txn_sizes.len())];
            (size, rng.random_range(0..spec.rollback_one_in) == 0)
        };
        let ids: Vec<String> = (0..size)
            .map(|_| uuid::Uuid::new_v4().to_string())
            .collect();
        match one_transaction(c, &ids, rollback).await {
            Ok(()) if rollback => out.rolled_back.extend(ids),
            Ok(()) => {
                out.sent.extend(ids.iter().cloned());
                out.committed.extend(ids);
            }
            Err(Stage::Before) => {
                out.rolled_back.extend(ids);
                client = None;
            }
            Err(Stage::Commit) => {
                out.sent.extend(ids.iter().cloned());
                out.uncertain.extend(ids);
                client = None;
            }
        }
        out.transactions += 1;
        tokio::time::sleep(spec.pause).await;
    }
    out
}

enum Stage {
    Before,
    Commit,
}

async fn one_transaction(
    c: &mut tokio_postgres::Client,
    ids: &[String],
    rollback: bool,
) -> Result<(), Stage> {
    let tx = c.transaction().await.map_err(|_| Stage::Before)?;
    tx.execute(
        "INSERT INTO outbox_events (event_id, event_name, payload, metadata)
         SELECT id::uuid, 'fault.test', jsonb_build_object('n', ord, 'pad', repeat('p', 64)),
                '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}'
         FROM unnest($1::text[]) WITH ORDINALITY AS t(id, ord) ORDER BY ord",
        &[&ids],
    )
    .await
    .map_err(|_| Stage::Before)?;
    if rollback {
        tx.rollback().await.map_err(|_| Stage::Before)
    } else {
        tx.commit().await.map_err(|_| Stage::Commit)
    }
}

/// What the checker found.
#[derive(Debug)]
pub struct Verdict {
    pub scenario: String,
    pub transactions: usize,
    pub committed: usize,
    pub delivered: usize,
    pub missing: Vec<String>,
    /// Ids pushed more than once to the pending list.
    pub duplicates: usize,
    /// Tasks of rolled-back transactions.
    pub leaked: usize,
    /// Committed ids whose first occurrence in the pending list comes before that of an id
    /// committed earlier (0 when the list is in commit order).
    pub out_of_order: usize,
    /// The first such pair: (committed earlier, pushed earlier).
    pub first_inversion: Option<(String, String)>,
    /// Tasks the relay re-sent that Valkey already had (`outbox_events_duplicate_total`).
    pub replays: u64,
    pub faults: usize,
}

impl Verdict {
    /// Nothing missing, nothing pushed twice, nothing leaked.
    pub fn ok(&self) -> bool {
        self.missing.is_empty() && self.duplicates == 0 && self.leaked == 0
    }

    /// [`ok`](Self::ok), and the pending list in commit order.
    pub fn ok_in_order(&self) -> bool {
        self.ok() && self.out_of_order == 0
    }

    /// For scenarios that must replay: the relay re-sent tasks Valkey already had, and the
    /// dedupe absorbed them (nothing pushed twice).
    pub fn assert_replayed(&self) {
        assert!(self.replays > 0, "the fault did not cause a replay: {self}");
        assert_eq!(self.duplicates, 0, "a replay was pushed twice: {self}");
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "FAULT-SUMMARY scenario={} faults={} transactions={} committed={} delivered={} missing={} duplicates={} leaked={} out_of_order={} replays={}",
            self.scenario,
            self.faults,
            self.transactions,
            self.committed,
            self.delivered,
            self.missing.len(),
            self.duplicates,
            self.leaked,
            self.out_of_order,
            self.replays
        )?;
        if let Some((earlier, pushed)) = &self.first_inversion {
            write!(f, " (committed first: {earlier}, pushed first: {pushed})")?;
        }
        Ok(())
    }
}

/// Waits (bounded) until every committed event is in the pending list, then compares. `replays`
/// is the relay's `outbox_events_duplicate_total` (summed over its processes).
pub async fn verify(
    scenario: &str,
    redis: &Redis,
    load: &LoadResult,
    faults: usize,
    replays: u64,
) -> Verdict {
    let mut conn = redis.conn().await;
    let committed: HashSet<&String> = load.committed.iter().collect();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let pending = loop {
        let pending = pending_ids(&mut conn, "default").await;
        let have: HashSet<&String> = pending.iter().collect();
        if committed.iter().all(|id| have.contains(id)) || tokio::time::Instant::now() > deadline {
            break pending;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Let anything still in flight land, so late duplicates would be seen too.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pending = {
        let again = pending_ids(&mut conn, "default").await;
        if again.len() >= pending.len() {
            again
        } else {
            pending
        }
    };
    let unique: HashSet<&String> = pending.iter().collect();
    let rolled_back: HashSet<&String> = load.rolled_back.iter().collect();
    let (out_of_order, first_inversion) = order_violations(&load.committed, &pending);
    let verdict = Verdict {
        scenario: scenario.to_owned(),
        transactions: load.transactions,
        committed: committed.len(),
        delivered: unique.iter().filter(|id| committed.contains(*id)).count(),
        missing: committed
            .iter()
            .filter(|id| !unique.contains(*id))
            .map(|s| s.to_string())
            .collect(),
        duplicates: pending.len() - unique.len(),
        leaked: unique.iter().filter(|id| rolled_back.contains(*id)).count(),
        out_of_order,
        first_inversion,
        replays,
        faults,
    };
    println!("{verdict}");
    verdict
}

/// Counts committed ids whose first occurrence in `pending` (oldest first) comes after that of
/// an id committed later; returns the count and the first inverted pair.
pub fn order_violations(
    committed: &[String],
    pending: &[String],
) -> (usize, Option<(String, String)>) {
    let position: std::collections::HashMap<&str, usize> = committed
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    let mut seen = HashSet::new();
    let mut latest: Option<(usize, &str)> = None;
    let mut count = 0;
    let mut first = None;
    for id in pending {
        let Some(&pos) = position.get(id.as_str()) else {
            continue;
        };
        if !seen.insert(pos) {
            continue;
        }
        match latest {
            Some((max, later)) if pos < max => {
                count += 1;
                first.get_or_insert_with(|| (id.clone(), later.to_owned()));
            }
            _ => latest = Some((pos, id)),
        }
    }
    (count, first)
}

/// Scale of the suite: the short form for CI, the long form with OUTBOX_FAULTS_LONG=1.
pub fn long() -> bool {
    std::env::var_os("OUTBOX_FAULTS_LONG").is_some()
}
