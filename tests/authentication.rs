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
    let mut admin = redis.conn().await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("relay")
        .arg("on")
        .arg(">acl-pw")
        .arg("resetkeys")
        .arg("~asynq:*")
        .arg("resetchannels")
        .arg("-@all")
        // The sink (and the commands its enqueue script runs), the monitor, status, peek.
        .arg("+evalsha")
        .arg("+script|load")
        .arg("+exists")
        .arg("+type")
        .arg("+hset")
        .arg("+lpush")
        .arg("+sadd")
        .arg("+ping")
        .arg("+smembers")
        .arg("+llen")
        .arg("+lrange")
        .arg("+hmget")
        .query_async(&mut admin)
        .await
        .unwrap();
    let acl_url = redis.url.replace("redis://", "redis://relay:acl-pw@");
    let relay =
        Relay::start_streaming(run_args(&role, &acl_url, &["--recovery-grace", "1s"])).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "scram.acl", 50, 10).await;
    assert_eq!(wait_pending(&redis, "default", 50).await, ids);
    // The marker's UPDATEs went through the SQL path as the SCRAM role.
    eventually("rows are marked published", || async {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (n == 0).then_some(())
    })
    .await;
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
