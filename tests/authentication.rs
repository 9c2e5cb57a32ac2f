//! Authentication: SCRAM-SHA-256 to PostgreSQL on both paths, and a Valkey ACL user allowed only
//! the commands the relay uses.

mod common;

use common::*;

/// The relay's role authenticates with SCRAM-SHA-256 (SQL connections and the replication
/// connection); Valkey with an ACL user allowed only the commands the relay uses (CONFIG GET,
/// for the eviction warning, is denied and tolerated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_role_and_a_valkey_acl_user_limited_to_the_relays_commands() {
    let pg = OwnPg::start_scram().await;
    let db = TestDb::on(&pg.url, "scram", true).await;
    let role = db.least_privilege_role_with_password("scram-pw").await;
    let redis = Redis::start();
    let acl_url = acl_user(&redis, RELAY_COMMANDS).await;
    let relay =
        Relay::start_streaming(run_args(&role, &acl_url, &["--recovery-grace", "1s"])).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "scram.acl", 50, 10).await;
    assert_eq!(wait_pending(&redis, "default", 50).await, ids);
    // The marker's UPDATEs went through the SQL path as the SCRAM role.
    wait_all_published(&c).await;
    let env: &[(&str, &str)] = &[
        ("OUTBOX_DATABASE_URL", &role.url),
        ("OUTBOX_VALKEY_URL", &acl_url),
        ("OUTBOX_SLOT", &db.slot),
    ];
    let (code, out, err) = run_command(&["status", "--json"], env);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["queues"][0]["pending"], 50, "{out}");
    let (code, out, err) = run_command(&["peek", "--limit", "2", "--json"], env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&ids[0]), "{out}");
    relay.stop().await;

    // A wrong password is refused with the server's message.
    let wrong = TestDb {
        url: role.url.replace("scram-pw", "not-it"),
        name: role.name.clone(),
        slot: role.slot.clone(),
    };
    let msg = Relay::failure(run_args(&wrong, &acl_url, &[])).await;
    assert!(msg.contains("password authentication failed"), "{msg}");
}

/// No MD5 on the replication connection (docs/configuration.md): the vendored pgwire-replication
/// is built without its `md5` feature, so a server that asks for MD5 is refused with a message
/// that says so, and the relay stops (an authentication refusal is not retried). The SQL
/// connections (tokio-postgres) do MD5, so the relay gets as far as the replication connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_asking_for_md5_is_refused_on_the_replication_connection() {
    let pg = OwnPg::start(&["-c", "password_encryption=md5"]);
    pg.set_hba(
        "local all all trust\n\
         host all postgres 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 md5\n",
    )
    .await;
    let db = TestDb::on(&pg.url, "md5", true).await;
    let role = db.least_privilege_role_with_password("md5-pw").await;
    let redis = Redis::start();
    let msg = Relay::failure(run_args(&role, &redis.url, &[])).await;
    assert!(msg.contains("unsupported auth method code: 5"), "{msg}");
}

/// The commands docs/configuration.md gives the relay's Valkey user: the sink (and the commands
/// its enqueue script runs, HMGET for the order fence), the monitor, status, peek.
const RELAY_COMMANDS: &[&str] = &[
    "+evalsha",
    "+script|load",
    "+exists",
    "+type",
    "+hset",
    "+lpush",
    "+sadd",
    "+ping",
    "+smembers",
    "+llen",
    "+lrange",
    "+hmget",
];

/// Creates the ACL user `relay` on the keys `asynq:*` allowed `commands` only; its URL.
async fn acl_user(redis: &Redis, commands: &[&str]) -> String {
    acl_user_on(redis, &["~asynq:*"], commands).await
}

/// Creates the ACL user `relay` on the key patterns `keys` allowed `commands` only; its URL.
async fn acl_user_on(redis: &Redis, keys: &[&str], commands: &[&str]) -> String {
    let mut admin = redis.conn().await;
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg("relay")
        .arg("on")
        .arg(">acl-pw")
        .arg("resetkeys");
    for k in keys {
        cmd.arg(*k);
    }
    cmd.arg("resetchannels").arg("-@all");
    for c in commands {
        cmd.arg(*c);
    }
    let _: () = cmd.query_async(&mut admin).await.unwrap();
    redis.url.replace("redis://", "redis://relay:acl-pw@")
}

/// A Valkey user set up before the order fence needed HMGET (it was listed for status and peek
/// only) would have every stream script call after a chain's first refused with NOPERM, its
/// rows left to the recovery poller (found by review). `run` refuses to stream instead, saying
/// what to add.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valkey_user_without_hmget_is_refused_before_streaming() {
    let db = TestDb::new("acl_hmget").await;
    let redis = Redis::start();
    let without: Vec<&str> = RELAY_COMMANDS
        .iter()
        .copied()
        .filter(|c| *c != "+hmget")
        .collect();
    let acl_url = acl_user(&redis, &without).await;
    let msg = tokio::time::timeout(PATIENCE, Relay::failure(run_args(&db, &acl_url, &[])))
        .await
        .expect("the relay went on running as a user without HMGET");
    assert!(msg.contains("add +hmget"), "{msg}");
}

/// Key patterns written for asynq's keys before the order fence (the task hashes, the pending
/// lists, the queue set): the stream's script declares `asynq:{<queue>}:outbox_relay_order`
/// too, so every call would be refused and every row left to the poller (found by review).
/// `run` refuses to stream, naming the key; poll mode, whose calls do not declare that key,
/// delivers as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_patterns_without_the_order_key_refuse_the_stream_and_not_the_poller() {
    let db = TestDb::new("acl_keys").await;
    let redis = Redis::start();
    let narrow = ["~asynq:{*}:t:*", "~asynq:{*}:pending", "~asynq:queues"];
    let acl_url = acl_user_on(&redis, &narrow, RELAY_COMMANDS).await;
    let msg = tokio::time::timeout(PATIENCE, Relay::failure(run_args(&db, &acl_url, &[])))
        .await
        .expect("the relay streamed as a user that may not read the order key");
    assert!(msg.contains("outbox_relay_order"), "{msg}");
    let relay = Relay::start(run_args(
        &db,
        &acl_url,
        &["--mode", "poll", "--poll-interval", "200ms"],
    ));
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "poll.narrow", 10, 10).await;
    assert_eq!(wait_pending(&redis, "default", 10).await, ids);
    relay.stop().await;
}

/// With `OUTBOX_VALKEY_WAIT_REPLICAS` every write also sets the wait's mark and runs WAIT: a
/// user allowed only the documented commands would have every write refused and sent again,
/// for ever (found by review). `run` refuses to start instead, naming what to add; with them
/// added it starts (no replica here: WAIT 0 at start answers at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_wait_without_set_and_wait_in_the_acl_is_refused_at_start() {
    let db = TestDb::new("acl_wait").await;
    let redis = Redis::start();
    let wait = ["--valkey-wait-replicas", "1", "--recovery-grace", "1h"];
    let acl_url = acl_user(&redis, RELAY_COMMANDS).await;
    let msg = tokio::time::timeout(PATIENCE, Relay::failure(run_args(&db, &acl_url, &wait)))
        .await
        .expect("the relay started without SET and WAIT in its ACL");
    assert!(msg.contains("+set +wait"), "{msg}");
    let mut with_wait = RELAY_COMMANDS.to_vec();
    with_wait.extend(["+set", "+wait", "+role"]);
    let acl_url = acl_user(&redis, &with_wait).await;
    Relay::start_streaming(run_args(&db, &acl_url, &wait))
        .await
        .stop()
        .await;
    // No replica here: every write would fail until one is connected, and the start says so.
    let warned = logged(&db.slot, "fewer Valkey replicas are connected");
    assert!(
        warned.iter().any(|l| l.contains("connected=0")),
        "{warned:?}"
    );
}
