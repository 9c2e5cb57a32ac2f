//! The relay through Sentinel (a primary, a replica and three sentinels started by
//! scripts/valkey-sentinel-start.sh): it writes to the primary the sentinels name, and follows
//! a failover under load.

mod common;

use common::certs::Certs;
use common::topologies::{assert_each_delivered_once, Producer, ValkeySentinel};
use common::*;
use std::collections::HashMap;

/// Under continuous load the primary is SIGKILLed; the sentinels (quorum 2, down after 1 s)
/// promote the replica, and the relay, whose writes fail meanwhile, asks the sentinels again
/// and carries on with the new primary. No committed event is missing, none is enqueued twice.
///
/// The relay acknowledges an event only after Valkey answered its write, but Valkey
/// replicates asynchronously: a primary killed at a random moment may take writes it already
/// answered with it, which is Valkey's durability, not the relay's. To test the relay's part
/// deterministically the primary first stops taking writes (`CLIENT PAUSE WRITE`: the relay's
/// writes wait, unanswered) and the replica catches up; only then is it killed, and the
/// failover itself is the sentinels' own, as after a crash. (`SENTINEL FAILOVER` alone would not
/// do: it promotes the replica without stopping writes on the old primary first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_follows_a_sentinel_failover_under_load() {
    let sentinel = ValkeySentinel::start();
    let db = TestDb::new("sentinel").await;
    let relay = Relay::start_streaming(run_args(
        &db,
        &sentinel.urls,
        &[
            "--valkey-sentinel-master",
            &sentinel.name,
            "--batch-size",
            "50",
        ],
    ))
    .await;
    let first = sentinel.primary_port();
    let producer = Producer::start(&db.url, &["order.placed"]);
    producer.wait_for_more(300).await;
    {
        // The relay writes to the primary.
        let mut conn = sentinel.conn(first).await;
        assert!(!pending_ids(&mut conn, "default").await.is_empty());
    }

    let second = sentinel.kill_primary().await;
    assert_ne!(first, second);
    producer.wait_for_more(300).await;

    let committed = producer.stop().await;
    let expected: HashMap<String, Vec<String>> = HashMap::from([(
        "default".to_owned(),
        committed.into_iter().map(|(_, id)| id).collect(),
    )]);
    let mut conn = sentinel.conn(second).await;
    assert_each_delivered_once(&mut conn, &expected).await;
    assert!(
        relay.metrics.write_errors.get() > 0,
        "the failover was felt by the relay (and retried)"
    );

    // `peek` and `status` find the new primary through the sentinels too.
    let target = run_args(
        &db,
        &sentinel.urls,
        &["--valkey-sentinel-master", &sentinel.name],
    )
    .valkey
    .target()
    .unwrap();
    let mut valkey = target.connect().await.unwrap();
    let peeked = outbox_relay::inspect::peek(&mut valkey, "default", 3)
        .await
        .unwrap();
    assert_eq!(
        peeked.iter().map(|t| t.id.clone()).collect::<Vec<_>>(),
        expected["default"][..3]
    );
    let c = db.client().await;
    let status = outbox_relay::status::collect(
        &c,
        Some(valkey),
        &outbox_relay::pgoutput::TableName::parse("outbox_events").unwrap(),
        "outbox_relay",
        &db.slot,
        relay.http,
    )
    .await
    .unwrap();
    let queues = status.queues.expect("status reaches the primary");
    assert_eq!(queues.len(), 1);
    assert_eq!(queues[0].pending, expected["default"].len() as i64);
    relay.stop().await;
}

/// rediss:// to sentinels, a primary and a replica that all speak TLS only and require a client
/// certificate (`--tls-auth-clients yes`; replication and the sentinels' links use TLS too): with
/// the CA file and the client certificate the relay asks the sentinels and delivers to the
/// primary. Without the CA file (Mozilla's roots) it cannot connect and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_sentinels_with_a_ca_file_and_a_client_certificate() {
    let certs = Certs::new();
    let sentinel = ValkeySentinel::start_with(&[], Some(&certs));
    assert!(sentinel.urls.starts_with("rediss://"), "{}", sentinel.urls);
    let db = TestDb::new("sentinel_tls").await;
    let master = ["--valkey-sentinel-master", sentinel.name.as_str()];
    let tls = certs.relay_valkey_tls(Some("ca.crt"), true);
    let relay = Relay::start_streaming(run_args(
        &db,
        &sentinel.urls,
        &[&master[..], &tls.flags()].concat(),
    ))
    .await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "sentinel.tls", 20, 5).await;
    let expected = HashMap::from([("default".to_owned(), ids)]);
    let mut conn = sentinel.conn(sentinel.first_primary_port()).await;
    assert_each_delivered_once(&mut conn, &expected).await;
    relay.stop().await;

    let mozilla_roots = certs.relay_valkey_tls(None, true);
    let msg = Relay::failure(run_args(
        &db,
        &sentinel.urls,
        &[&master[..], &mozilla_roots.flags()].concat(),
    ))
    .await;
    assert!(
        msg.contains("cannot reach Valkey at rediss://") && msg.contains("UnknownIssuer"),
        "{msg}"
    );
}
