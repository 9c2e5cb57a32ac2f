//! The relay against a real Valkey/Redis Cluster (three primaries, three replicas, started by
//! scripts/valkey-cluster-start.sh): tasks of several queues on several shards, and failovers
//! under load.

mod common;

use common::certs::Certs;
use common::topologies::{assert_each_delivered_once, Producer, ValkeyCluster};
use common::*;
use std::collections::{HashMap, HashSet};

/// Event name -> queue; the three queues' `{queue}` hash tags fall on the three primaries of a
/// fresh cluster (checked below, not assumed).
const ROUTES: &str = "order.*=orders,payment.*=critical,user.*=low";
const NAMES: [(&str, &str); 3] = [
    ("order.placed", "orders"),
    ("payment.done", "critical"),
    ("user.signed_up", "low"),
];

fn cluster_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--valkey-cluster", "true", "--queue-routes", ROUTES];
    args.extend_from_slice(extra);
    args
}

/// queue -> committed ids, in commit order.
fn by_queue(committed: &[(String, String)]) -> HashMap<String, Vec<String>> {
    let queue_of: HashMap<&str, &str> = NAMES.iter().copied().collect();
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for (name, id) in committed {
        out.entry(queue_of[name.as_str()].to_owned())
            .or_default()
            .push(id.clone());
    }
    out
}

/// Inserts `n` events cycling through the three names, `per_txn` rows per transaction (so a
/// transaction, and a batch, holds tasks of every queue); returns (name, id) in commit order.
async fn insert_mixed(
    client: &mut tokio_postgres::Client,
    n: usize,
    per_txn: usize,
) -> Vec<(String, String)> {
    let names: Vec<&str> = NAMES.iter().map(|(n, _)| *n).collect();
    insert_named_events(client, &names, n, per_txn).await
}

/// Every event becomes exactly its task, on the shard of its queue, in commit order per queue;
/// `asynq:queues` lists the queues; `status` and `peek` read through the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_of_three_queues_land_on_three_shards_exactly_once() {
    let cluster = ValkeyCluster::start();
    // The three queues live on three different primaries.
    let owners: HashSet<String> = NAMES
        .iter()
        .map(|(_, q)| {
            cluster
                .primary_of(cluster.slot(&format!("asynq:{{{q}}}:pending")))
                .id
        })
        .collect();
    assert_eq!(owners.len(), 3, "the queues spread over the three shards");

    let db = TestDb::new("cluster").await;
    let relay = Relay::start_streaming(run_args(
        &db,
        &cluster.urls,
        &cluster_args(&[
            "--task-max-retry",
            "7",
            "--task-timeout",
            "90s",
            "--batch-size",
            "100",
        ]),
    ))
    .await;
    let mut c = db.client().await;
    let mut committed = insert_mixed(&mut c, 600, 1).await;
    committed.extend(insert_mixed(&mut c, 1500, 30).await);
    committed.extend(insert_mixed(&mut c, 900, 300).await);
    let expected = by_queue(&committed);

    let mut conn = cluster.conn().await;
    assert_each_delivered_once(&mut conn, &expected).await;
    for (queue, ids) in &expected {
        assert_eq!(
            &pending_ids(&mut conn, queue).await,
            ids,
            "queue {queue} holds its ids in commit order"
        );
        for id in ids.iter().step_by(97) {
            let (msg, state, since) = task(&mut conn, queue, id).await.expect("task hash");
            assert_eq!(state, "pending");
            assert!(since.parse::<u128>().unwrap() > 0);
            assert_eq!(msg.id, *id);
            assert_eq!(&msg.queue, queue);
            assert_eq!((msg.retry, msg.timeout), (7, 90));
            let env: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
            assert_eq!(env["id"], *id);
            assert_eq!(
                format!("event:{}", env["name"].as_str().unwrap()),
                msg.r#type
            );
        }
    }
    assert_eq!(queues(&mut conn).await, ["critical", "low", "orders"]);

    // The operator commands' view, through the same kind of connection as `run`.
    let target = run_args(&db, &cluster.urls, &cluster_args(&[]))
        .valkey
        .target()
        .unwrap();
    let mut valkey = target.connect().await.unwrap();
    let status = outbox_relay::status::collect(
        &c,
        Some(valkey.clone()),
        &outbox_relay::pgoutput::TableName::parse("outbox_events").unwrap(),
        "outbox_relay",
        &db.slot,
        relay.http,
    )
    .await
    .unwrap();
    assert_eq!(status.relay.stream_up, Some(true), "{:?}", status.relay);
    assert!(status.warnings.is_empty(), "{:?}", status.warnings);
    let lengths: HashMap<String, i64> = status
        .queues
        .expect("status reaches the cluster")
        .into_iter()
        .map(|q| (q.queue, q.pending))
        .collect();
    for (queue, ids) in &expected {
        assert_eq!(lengths[queue], ids.len() as i64, "status: queue {queue}");
    }
    let peeked = outbox_relay::inspect::peek(&mut valkey, "low", 5)
        .await
        .unwrap();
    assert_eq!(
        peeked.iter().map(|t| t.id.clone()).collect::<Vec<_>>(),
        expected["low"][..5]
    );
    relay.stop().await;
}

/// Under continuous load, first a coordinated failover of one shard (`CLUSTER FAILOVER` on its
/// replica: the old primary answers MOVED afterwards), then the SIGKILL of another shard's
/// primary, which the cluster replaces by promoting its replica (node timeout 2 s). No committed
/// event is missing and none is enqueued twice.
///
/// The relay's guarantee is that it acknowledges an event only after Valkey answered its
/// write. Valkey replicates asynchronously, so a primary killed at a random moment may take
/// writes it already answered with it: that is Valkey's durability, not the relay's. To test
/// the relay's part deterministically, the killed primary first stops taking writes
/// (`CLIENT PAUSE WRITE`: the relay's writes wait, unanswered) and its replica catches up;
/// only then is it killed. The writes it never answered fail in the relay, which retries them
/// on the promoted replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_under_load_lose_no_event() {
    let cluster = ValkeyCluster::start();
    let db = TestDb::new("cluster_fo").await;
    let relay = Relay::start_streaming(run_args(
        &db,
        &cluster.urls,
        &cluster_args(&["--batch-size", "50"]),
    ))
    .await;
    let producer = Producer::start(&db.url, &NAMES.map(|(n, _)| n));
    producer.wait_for_more(300).await;

    // A coordinated failover of the shard of `orders`.
    let primary = cluster.primary_of(cluster.slot("asynq:{orders}:pending"));
    let replica = cluster.replica_of(&primary);
    cluster.coordinated_failover(&replica).await;
    producer.wait_for_more(300).await;

    // The primary of `low` dies; the cluster promotes its replica.
    let primary = cluster.primary_of(cluster.slot("asynq:{low}:pending"));
    let replica = cluster.replica_of(&primary);
    cluster.kill_primary(&primary, &replica).await;
    producer.wait_for_more(300).await;

    let committed = producer.stop().await;
    let expected = by_queue(&committed);
    let mut conn = cluster.conn().await;
    assert_each_delivered_once(&mut conn, &expected).await;
    assert!(
        relay.metrics.write_errors.get() > 0,
        "the failovers were felt by the relay (and retried)"
    );
    println!(
        "cluster failovers: {} events committed, all delivered; {} failed writes retried",
        committed.len(),
        relay.metrics.write_errors.get()
    );
    relay.stop().await;
}

/// rediss:// to a cluster whose nodes speak TLS only and require a client certificate
/// (`--tls-auth-clients yes`; the cluster bus and replication use TLS too): with the CA file and
/// the client certificate the relay delivers every event to its queue's shard, once. Without the
/// CA file (Mozilla's roots) it cannot connect and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_cluster_with_a_ca_file_and_a_client_certificate() {
    let certs = Certs::new();
    let cluster = ValkeyCluster::start_tls(&certs);
    assert!(cluster.urls.starts_with("rediss://"), "{}", cluster.urls);
    let db = TestDb::new("cluster_tls").await;
    let tls = certs.relay_valkey_tls(Some("ca.crt"), true);
    let relay =
        Relay::start_streaming(run_args(&db, &cluster.urls, &cluster_args(&tls.flags()))).await;
    let mut c = db.client().await;
    let committed = insert_mixed(&mut c, 30, 5).await;
    let expected = by_queue(&committed);
    let mut conn = cluster.conn().await;
    assert_each_delivered_once(&mut conn, &expected).await;
    relay.stop().await;

    let mozilla_roots = certs.relay_valkey_tls(None, true);
    let msg = Relay::failure(run_args(
        &db,
        &cluster.urls,
        &cluster_args(&mozilla_roots.flags()),
    ))
    .await;
    assert!(
        msg.contains("cannot reach Valkey at rediss://") && msg.contains("UnknownIssuer"),
        "{msg}"
    );
}

/// Two writes through one cluster sink over the same eight queues, issued at the same moment on
/// two threads (as the stream and a poller on two worker threads can): each takes its
/// per-queue tickets (src/sink/queue_turns.rs) all at once, so neither can hold an earlier
/// ticket on one queue and a later one on another and wait for the other for ever. Found by
/// review with tickets taken one queue at a time: a deadlock at round 1,772 of such pairs. A
/// pair that does not end within the patience bound fails the test.
#[test]
fn writes_issued_at_the_same_moment_on_two_threads_never_wait_for_each_other() {
    use outbox_relay::sink::valkey::ValkeySink;
    use outbox_relay::sink::{Batch, Sink};
    use outbox_relay::task::Task;
    use outbox_relay::valkey::{Topology, ValkeyTarget};
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    const QUEUES: [&str; 8] = ["q0", "q1", "q2", "q3", "q4", "q5", "q6", "q7"];
    /// The queues in another order for each writer, so their tickets would cross.
    fn batch(rotate: usize) -> Arc<Batch> {
        let mut b = Batch::default();
        for k in 0..QUEUES.len() {
            b.push(Task {
                queue: Arc::from(QUEUES[(k + rotate) % QUEUES.len()]),
                id: uuid::Uuid::new_v4().to_string(),
                msg: b"x".to_vec(),
                row_id: None,
            });
        }
        Arc::new(b)
    }

    let cluster = ValkeyCluster::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sink = rt.block_on(async {
        let target = ValkeyTarget::new(
            &cluster.urls,
            &Topology::Cluster,
            Duration::from_secs(5),
            None,
        )
        .unwrap();
        ValkeySink::connect(target).await.expect("connect")
    });
    for round in 0..2000 {
        let barrier = Arc::new(Barrier::new(2));
        let issue = |rotate: usize| {
            // Leaked: the trait's `write` future borrows the sink (edition 2021 capture rules).
            let sink: &'static ValkeySink = Box::leak(Box::new(sink.clone()));
            let barrier = barrier.clone();
            let handle = rt.handle().clone();
            std::thread::spawn(move || {
                let _runtime = handle.enter();
                let b = batch(rotate);
                barrier.wait();
                sink.write(b)
            })
        };
        let (w, p) = (issue(0), issue(3));
        let (w, p) = (w.join().unwrap(), p.join().unwrap());
        let both = rt
            .block_on(async { tokio::time::timeout(PATIENCE, futures::future::join(w, p)).await });
        match both {
            Ok((a, b)) => {
                a.expect("write");
                b.expect("write");
            }
            Err(_) => panic!("round {round}: two writes issued at once never ended"),
        }
    }
}

/// A write to a shard whose primary was killed reaches the replica the cluster promoted, when
/// the caller follows the writer's rule (after an error that poisons the connection, reset the
/// sink and write again); the write under way when the primary died fails, it never succeeds.
///
/// This is the sink's part of `failovers_under_load_lose_no_event`, alone. It passes without
/// the cluster connection being made again (src/valkey/cluster_link.rs) too: with one writer
/// and no load, redis' client finds no connection for the slot and reads the slot map. The
/// path that needed the rebuild (the client reconnecting to the dead primary for ever, every
/// write failing with "broken pipe") showed only under the relay's load; see docs/reliability.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_follow_a_killed_primary_to_its_promoted_replica() {
    use outbox_relay::sink::valkey::ValkeySink;
    use outbox_relay::sink::{Batch, Sink};
    use outbox_relay::task::Task;
    use outbox_relay::valkey::{Topology, ValkeyTarget};
    use std::sync::Arc;
    use std::time::Duration;

    fn one_task(id: &str) -> Arc<Batch> {
        let mut b = Batch::default();
        b.push(Task {
            queue: Arc::from("low"),
            id: id.to_string(),
            msg: b"x".to_vec(),
            row_id: None,
        });
        Arc::new(b)
    }

    let cluster = ValkeyCluster::start();
    let target = ValkeyTarget::new(
        &cluster.urls,
        &Topology::Cluster,
        Duration::from_secs(5),
        None,
    )
    .unwrap();
    let sink = ValkeySink::connect(target).await.expect("connect");
    sink.write(one_task("before")).await.expect("write before");

    let primary = cluster.primary_of(cluster.slot("asynq:{low}:pending"));
    let replica = cluster.replica_of(&primary);
    // A write under way when the primary dies, as under load: it waits on the paused primary.
    common::topologies::cli(primary.port, &["CLIENT", "PAUSE", "60000", "WRITE"]).unwrap();
    let in_flight = tokio::spawn({
        let sink = sink.clone();
        async move { sink.write(one_task("in-flight")).await }
    });
    cluster.kill_primary(&primary, &replica).await;
    let lost_with_the_primary = in_flight.await.unwrap();
    assert!(
        lost_with_the_primary.is_err(),
        "a write the killed primary never answered cannot have succeeded"
    );

    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut failures = 0;
    loop {
        match sink.write(one_task("after")).await {
            Ok(_) => break,
            Err(e) => {
                failures += 1;
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "after {failures} failed writes the shard's promoted replica was never \
                     written to; the last error: {e}"
                );
                if e.poisons_connection() {
                    sink.reset();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let mut conn = cluster.conn().await;
    let pending = pending_ids(&mut conn, "low").await;
    assert_eq!(pending, ["before", "after"], "both writes landed, in order");
    println!("the killed primary's shard was written after {failures} failed writes");
}
