//! A poller's SQL connection cut off while its transaction holds row locks: the server must end
//! that session on its own (the relay sets `idle_in_transaction_session_timeout` and
//! `tcp_user_timeout` in each poll transaction, src/store/pg.rs), so that the locks go and
//! another poller delivers the rows. The cut is the fault proxy's black hole
//! (tests/common/proxy.rs): its kernel still acknowledges, so the server's TCP keepalive, which
//! was all that could end such a session before, never would.

mod common;

use common::proxy::{Fault, Proxy};
use common::*;

/// The rows of this test, all marked published (or deleted).
async fn all_published(c: &tokio_postgres::Client) -> bool {
    unpublished_rows(c).await == 0
}

/// The backend idle in a transaction that holds a lock on the outbox table, if any.
async fn lock_holder(c: &tokio_postgres::Client) -> Option<i32> {
    c.query_opt(
        "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid \
         WHERE a.datname = current_database() AND a.state = 'idle in transaction' \
         AND l.locktype = 'relation' AND l.relation = 'outbox_events'::regclass LIMIT 1",
        &[],
    )
    .await
    .unwrap()
    .map(|r| r.get(0))
}

async fn backend_alive(c: &tokio_postgres::Client, pid: i32) -> bool {
    c.query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poller_cut_off_while_holding_row_locks_releases_them() {
    let db = TestDb::new("pl_cut").await;
    let redis = Redis::start();
    let pg_proxy = Proxy::in_front_of(&db.url).await;
    let valkey_proxy = Proxy::in_front_of(&redis.url).await;
    // Poll mode, one poller, one chunk per round: its transaction may stay idle for one Valkey
    // write (3 x 2 s, plus 8 s for 8 MiB at 1 MiB/s) plus the link timeout (3 s), 17 s, before
    // the server ends it.
    let flags = [
        "--mode",
        "poll",
        "--pollers",
        "1",
        "--batch-size",
        "10",
        "--poll-interval",
        "200ms",
        "--valkey-timeout",
        "2s",
        "--link-timeout",
        "3s",
        "--health-interval",
        "1h",
    ];
    let cut_db = TestDb {
        url: pg_proxy.url_through(&db.url),
        name: db.name.clone(),
        slot: db.slot.clone(),
    };
    let a = Relay::start(run_args(
        &cut_db,
        &valkey_proxy.url_through(&redis.url),
        &flags,
    ));
    let admin = db.client().await;
    eventually("the first relay polls", || async {
        (a.metrics.poller_rounds.get() >= 1).then_some(())
    })
    .await;
    // From now on its Valkey writes reach nothing: a round waits out its write timeout (6 s)
    // idle in its transaction, holding the rows' locks.
    valkey_proxy.set(Fault::BlackHole);
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "locked", 10, 10).await;
    let holder = eventually("the poller holds the rows' locks", || async {
        lock_holder(&admin).await
    })
    .await;
    // Its SQL connections reach nothing either, open and new ones.
    pg_proxy.set_sql(Fault::BlackHole);
    // Still held after the cut, and not marked: the cut came while the poller held them.
    assert_eq!(
        lock_holder(&admin).await,
        Some(holder),
        "cut while holding the locks"
    );
    assert!(!all_published(&admin).await);

    // Another relay's poller, straight to the server, skips locked rows.
    let b = Relay::start(run_args(&db, &redis.url, &flags));
    eventually("the other poller delivers the rows", || async {
        all_published(&admin).await.then_some(())
    })
    .await;
    assert!(
        !backend_alive(&admin, holder).await,
        "the server ended the cut-off session"
    );
    let pending = wait_pending(&redis, "default", ids.len()).await;
    assert!(ids.iter().all(|id| pending.contains(id)));
    println!("POLLER-CUT locks_released=1 delivered={}", ids.len());
    b.stop().await;
    drop(a);
}

/// The relay's sessions run READ COMMITTED whatever the database's default (found by review):
/// under SERIALIZABLE or REPEATABLE READ, `FOR UPDATE SKIP LOCKED` fails with 40001 on a row
/// another poller marked after the claim's snapshot, and the marker's UPDATEs likewise. Here
/// the database defaults to SERIALIZABLE: a plain session has it, the relay's pool does not,
/// and a relay streams and marks on it (its replication connection takes the same options).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_sessions_read_committed_whatever_the_database_default() {
    let db = TestDb::new("isolation").await;
    let admin = db.client().await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} SET default_transaction_isolation = 'serializable'",
            db.name
        ))
        .await
        .unwrap();
    let plain = db.client().await;
    let shown: String = plain
        .query_one("SHOW default_transaction_isolation", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        shown, "serializable",
        "the database's default, as a plain session has it"
    );
    let target = outbox_relay::postgres::PgTarget::parse(&db.url).unwrap();
    let pool = target.pool(1);
    let relays = pool.get().await.unwrap();
    let shown: String = relays
        .query_one("SHOW default_transaction_isolation", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, "read committed", "the relay's own sessions");
    let redis = Redis::start();
    let relay =
        Relay::start_streaming(run_args(&db, &redis.url, &["--recovery-grace", "1s"])).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "isolation.rc", 20, 5).await;
    assert_eq!(wait_pending(&redis, "default", 20).await, ids);
    wait_all_published(&c).await;
    relay.stop().await;
}
