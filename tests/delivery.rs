//! The delivery core against real servers: the interleavings the simulation (tests/sim) found
//! or that review found, end to end. Each test names the fault and the promise it checks.

mod common;

use common::*;
use std::time::Duration;

/// Flags that let the recovery poller act quickly.
const QUICK_RECOVERY: [&str; 6] = [
    "--recovery-grace",
    "2s",
    "--poll-interval",
    "200ms",
    "--attempt-backoff",
    "200ms",
];

/// The ids of every task hash of `queue`.
async fn task_keys(conn: &mut redis::aio::MultiplexedConnection, queue: &str) -> Vec<String> {
    redis::cmd("KEYS")
        .arg(format!("asynq:{{{queue}}}:t:*"))
        .query_async(conn)
        .await
        .unwrap()
}

async fn redis_cmd(conn: &mut redis::aio::MultiplexedConnection, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let _: redis::Value = cmd.query_async(conn).await.unwrap();
}

/// The issue-12 interleaving: writes to one queue are refused while another's succeed, and the
/// relay is stopped (SIGTERM) during it. Before the fix the final acknowledgement passed the
/// refused transaction and its rows were marked published: lost. Now the refused rows stay
/// unpublished for the poller, which delivers them once the queue takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_one_queue_is_refused_loses_nothing() {
    let db = TestDb::new("d_refused").await;
    let redis = Redis::start();
    let mut admin = redis.conn().await;
    // The relay's user may write queue qa (and the queue set) but not qb.
    redis_cmd(
        &mut admin,
        &[
            "ACL",
            "SETUSER",
            "relay",
            "on",
            ">relay-pw",
            "~asynq:{qa}:*",
            "~asynq:queues",
            "+@all",
        ],
    )
    .await;
    let url = redis.url.replace("redis://", "redis://relay:relay-pw@");
    let routes = ["--queue-routes", "a.*=qa,b.*=qb"];
    let flags = [&QUICK_RECOVERY[..], &routes[..]].concat();
    let mut relay = RelayProcess::spawn_streaming(&db, &url, &flags).await;
    let mut client = db.client().await;
    let b_ids = insert_events(&mut client, "b.refused", 20, 20).await;
    let a_ids = insert_events(&mut client, "a.accepted", 20, 20).await;
    let after = db.current_lsn().await;
    // qa's tasks arrive: the stream went past the refused transaction.
    wait_pending(&redis, "qa", a_ids.len()).await;
    relay.signal("TERM");
    let status = relay.child.wait().await.unwrap();
    assert!(status.success(), "SIGTERM exits 0: {status}");
    assert!(
        task_keys(&mut admin, "qb").await.is_empty(),
        "no task of the refused queue exists"
    );
    let unpublished: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NULL AND event_name = 'b.refused'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        unpublished,
        b_ids.len() as i64,
        "refused rows stay unpublished"
    );
    // The WAL is not pinned by the refused queue. The walsender applies the relay's last
    // acknowledgement before it sees the connection close: read the slot once it is released.
    db.wait_slot_released().await;
    assert!(db.confirmed_flush().await.unwrap() >= after);

    // The queue takes writes again; a new relay's poller delivers the refused rows.
    redis_cmd(&mut admin, &["ACL", "SETUSER", "relay", "allkeys"]).await;
    let relay = RelayProcess::spawn_streaming(&db, &url, &flags).await;
    let qb = wait_pending(&redis, "qb", b_ids.len()).await;
    let qa = pending_ids(&mut admin, "qa").await;
    assert_eq!(qa, a_ids, "qa: each task once, in commit order");
    let mut got = qb.clone();
    got.sort();
    let mut want = b_ids.clone();
    want.sort();
    assert_eq!(got, want, "qb: each refused row delivered exactly once");
    wait_all_published(&db.client().await).await;
    drop(relay);
}

/// A write that keeps failing when SIGTERM comes (Valkey refuses writes: CLIENT PAUSE WRITE)
/// is not acknowledged: the final acknowledgement stops before it, and the next relay delivers
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_failing_writes_acknowledges_only_what_valkey_confirmed() {
    let db = TestDb::new("d_paused").await;
    let redis = Redis::start();
    let mut admin = redis.conn().await;
    let flags = ["--shutdown-timeout", "2s", "--valkey-timeout", "500ms"];
    let mut relay = RelayProcess::spawn_streaming(&db, &redis.url, &flags).await;
    let mut client = db.client().await;
    let first = insert_events(&mut client, "order.placed", 10, 10).await;
    wait_pending(&redis, "default", first.len()).await;
    let before = db.current_lsn().await;
    redis_cmd(&mut admin, &["CLIENT", "PAUSE", "60000", "WRITE"]).await;
    let second = insert_events(&mut client, "order.placed", 10, 10).await;
    let after = db.current_lsn().await;
    // The relay has read the rows and is failing to write them.
    eventually("write errors", || {
        let relay = &relay;
        async move {
            relay
                .log_text()
                .contains("valkey write failed")
                .then_some(())
        }
    })
    .await;
    relay.signal("TERM");
    let status = relay.child.wait().await.unwrap();
    assert!(status.success(), "SIGTERM exits 0: {status}");
    db.wait_slot_released().await;
    let confirmed = db.confirmed_flush().await.unwrap();
    assert!(
        confirmed >= before,
        "the first transaction was acknowledged"
    );
    assert!(
        confirmed < after,
        "the unconfirmed transaction was not acknowledged ({confirmed} < {after})"
    );
    redis_cmd(&mut admin, &["CLIENT", "UNPAUSE"]).await;
    let relay = RelayProcess::spawn_streaming(&db, &redis.url, &flags).await;
    let ids = wait_pending(&redis, "default", first.len() + second.len()).await;
    assert_eq!(
        ids,
        [first, second].concat(),
        "each task once, in commit order"
    );
    drop(relay);
}

/// A queue whose pending list has the wrong type (WRONGTYPE: it can never take a task until an
/// operator fixes it) neither stalls the other queues nor pins WAL, and writes nothing for its
/// tasks (no hash without its pending entry); its rows wait unpublished, the poller counts their
/// attempts and dead-letters them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_queue_stalls_nothing_and_its_rows_become_dead_letters() {
    let db = TestDb::new("d_wrongtype").await;
    let redis = Redis::start();
    let mut admin = redis.conn().await;
    redis_cmd(&mut admin, &["SET", "asynq:{qb}:pending", "not a list"]).await;
    let args = run_args(
        &db,
        &redis.url,
        &[
            &QUICK_RECOVERY[..],
            &["--queue-routes", "a.*=qa,b.*=qb", "--max-attempts", "2"],
        ]
        .concat(),
    );
    let relay = Relay::start_streaming(args).await;
    let mut client = db.client().await;
    let mut a_ids = Vec::new();
    let mut b_ids = Vec::new();
    for _ in 0..5 {
        a_ids.extend(insert_events(&mut client, "a.ok", 4, 4).await);
        b_ids.extend(insert_events(&mut client, "b.broken", 3, 3).await);
    }
    let after = db.current_lsn().await;
    let qa = wait_pending(&redis, "qa", a_ids.len()).await;
    assert_eq!(qa, a_ids, "the healthy queue gets every task, in order");
    eventually("the slot passes the broken queue's commits", || {
        let db = &db;
        async move { (db.confirmed_flush().await.unwrap() >= after).then_some(()) }
    })
    .await;
    assert!(
        task_keys(&mut admin, "qb").await.is_empty(),
        "all or nothing: no task hash of the broken queue"
    );
    let broken = b_ids.len() as i64;
    eventually("the broken queue's rows become dead letters", || {
        let db = &db;
        async move {
            let n: i64 = db
                .client()
                .await
                .query_one(
                    "SELECT count(*) FROM outbox_events WHERE dead_at IS NOT NULL \
                     AND published_at IS NULL AND attempts = 2 AND event_name = 'b.broken'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (n == broken).then_some(())
        }
    })
    .await;
    assert!(relay.metrics.rows_rejected.get() >= b_ids.len() as u64);
    relay.stop().await;
}

/// The outbox is the table the search path names: a table of the same name in another schema
/// of the publication is not, and its ids never mark the outbox's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_named_table_in_another_schema_is_not_the_outbox() {
    let db = TestDb::new("d_schema").await;
    let redis = Redis::start();
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE SCHEMA archive;
             CREATE TABLE archive.outbox_events (LIKE public.outbox_events INCLUDING ALL);
             ALTER PUBLICATION outbox_relay ADD TABLE archive.outbox_events;",
        )
        .await
        .unwrap();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;
    // Row 1 of the outbox is bad (no event name): it waits for the poller (grace 30 s).
    client
        .batch_execute(
            "INSERT INTO public.outbox_events (id, event_id, event_name, payload) OVERRIDING SYSTEM VALUE \
             VALUES (1000000, gen_random_uuid(), '', '{}');
             INSERT INTO archive.outbox_events (id, event_id, event_name, payload) OVERRIDING SYSTEM VALUE \
             VALUES (1000000, gen_random_uuid(), 'archived.event', '{}');",
        )
        .await
        .unwrap();
    let mut c = db.client().await;
    let good = insert_events(&mut c, "order.placed", 3, 3).await;
    let ids = wait_pending(&redis, "default", good.len()).await;
    assert_eq!(ids, good, "only the outbox's rows became tasks");
    let published: Option<std::time::SystemTime> = client
        .query_one(
            "SELECT published_at FROM public.outbox_events WHERE id = 1000000",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        published.is_none(),
        "the outbox's row 1 was not marked by the archive's row 1"
    );
    relay.stop().await;
    let _ = Duration::ZERO;
}
