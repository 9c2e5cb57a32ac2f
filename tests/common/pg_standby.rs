//! A Postgres primary with a streaming standby (physical replication), both started by the
//! project's scripts with the binaries the run uses (`OUTBOX_TEST_PG_BINDIR`): for failover and
//! decoding-on-a-standby tests.
//!
//! The standby is made from the primary stopped cleanly (a cold copy of its data directory
//! without its slots, the files a base backup leaves out): the system's pg_basebackup (15)
//! refuses newer servers, and the copy works for every version of the matrix.

use super::{connect, eventually, script, scripts, tmp_dir};
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// The standby's name: its physical slot on the primary and its application_name.
pub const STANDBY: &str = "standby1";

/// One server of the pair.
pub struct Node {
    dir: PathBuf,
    pub url: String,
    pub port: u16,
}

impl Node {
    fn start(dir: &Path) -> Self {
        let url = script("pg-start.sh", &[dir.to_str().unwrap()]);
        let port = std::fs::read_to_string(dir.join("port"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        Self {
            dir: dir.to_owned(),
            url,
            port,
        }
    }

    /// `pg-stop.sh DIR MODE --keep` (`immediate` is a crash).
    pub fn stop(&self, mode: &str) {
        script("pg-stop.sh", &[self.dir.to_str().unwrap(), mode, "--keep"]);
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::process::Command::new(scripts().join("pg-stop.sh"))
            .arg(&self.dir)
            .arg("immediate")
            .stderr(Stdio::null())
            .status();
    }
}

/// A primary and its streaming standby.
pub struct PgPair {
    pub primary: Node,
    pub standby: Node,
    /// `server_version_num / 10000`.
    pub major: i32,
}

fn run(cmd: &str, args: &[&str]) {
    let status = std::process::Command::new(cmd)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(status.success(), "{cmd} {args:?} failed");
}

fn is_root() -> bool {
    let out = std::process::Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

impl PgPair {
    /// Starts the pair and waits until the standby streams. Commits on the primary wait for the
    /// standby (`synchronous_standby_names`), so a commit the client saw is on both. From
    /// PostgreSQL 17 the standby also synchronizes failover slots (`sync_replication_slots`),
    /// and the primary sends logical changes only once the standby has them
    /// (`synchronized_standby_slots`).
    pub async fn start() -> Self {
        let dir_a = tmp_dir("pg-primary");
        let dir_b = tmp_dir("pg-standby");
        let primary = Node::start(&dir_a);
        let admin = connect(&primary.url).await;
        let major = server_major(&admin).await;
        admin
            .execute(
                "SELECT pg_create_physical_replication_slot($1)",
                &[&STANDBY],
            )
            .await
            .unwrap();
        drop(admin);
        // The cold copy, without slots and pid files.
        primary.stop("fast");
        let data_b = dir_b.join("data");
        run(
            "cp",
            &[
                "-a",
                primary.data_dir().to_str().unwrap(),
                data_b.to_str().unwrap(),
            ],
        );
        for f in ["postmaster.pid", "postmaster.opts"] {
            let _ = std::fs::remove_file(data_b.join(f));
        }
        for slot in std::fs::read_dir(data_b.join("pg_replslot")).unwrap() {
            std::fs::remove_dir_all(slot.unwrap().path()).unwrap();
        }
        std::fs::write(data_b.join("standby.signal"), "").unwrap();
        let mut conf = format!(
            "\nprimary_conninfo = 'host=127.0.0.1 port={} user=postgres dbname=postgres application_name={STANDBY}'\n\
             primary_slot_name = '{STANDBY}'\nhot_standby_feedback = on\n",
            primary.port
        );
        if major >= 17 {
            conf.push_str("sync_replication_slots = on\n");
        }
        let auto = data_b.join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&auto).unwrap();
        text.push_str(&conf);
        std::fs::write(&auto, text).unwrap();
        if is_root() {
            run(
                "chown",
                &["-R", "postgres:postgres", dir_b.to_str().unwrap()],
            );
        }
        // Back up, and the standby beside it.
        script("pg-start.sh", &[dir_a.to_str().unwrap()]);
        let standby = Node::start(&dir_b);
        let admin = connect(&primary.url).await;
        eventually("the standby streams", || {
            let admin = &admin;
            async move {
                let row = admin
                    .query_opt(
                        "SELECT 1 FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'",
                        &[&STANDBY],
                    )
                    .await
                    .unwrap();
                row.map(|_| ())
            }
        })
        .await;
        admin
            .batch_execute(&format!(
                "ALTER SYSTEM SET synchronous_standby_names = '{STANDBY}'"
            ))
            .await
            .unwrap();
        if major >= 17 {
            admin
                .batch_execute(&format!(
                    "ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY}'"
                ))
                .await
                .unwrap();
        }
        admin
            .batch_execute("SELECT pg_reload_conf()")
            .await
            .unwrap();
        Self {
            primary,
            standby,
            major,
        }
    }

    /// A URL naming both servers, primary first, for a read-write session on database `db`.
    pub fn multi_host_url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{db}?target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// Waits until the standby has replayed everything the primary has written so far.
    pub async fn wait_standby_caught_up(&self) {
        let primary = connect(&self.primary.url).await;
        let target: String = primary
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        let standby = connect(&self.standby.url).await;
        eventually("the standby replays the primary's WAL", || {
            let (standby, target) = (&standby, &target);
            async move {
                let row = standby
                    .query_one(
                        "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
                        &[target],
                    )
                    .await
                    .unwrap();
                row.get::<_, bool>(0).then_some(())
            }
        })
        .await;
    }

    /// `SELECT pg_promote()` on the standby (waits until it is done).
    pub async fn promote_standby(&self) {
        let ok: bool = connect(&self.standby.url)
            .await
            .query_one("SELECT pg_promote(true, 120)", &[])
            .await
            .unwrap()
            .get(0);
        assert!(ok, "pg_promote");
    }

    /// Crashes the old primary.
    pub fn kill_primary(&self) {
        self.primary.stop("immediate");
    }
}

/// The server's major version.
pub async fn server_major(client: &tokio_postgres::Client) -> i32 {
    let v: String = client
        .query_one("SHOW server_version_num", &[])
        .await
        .unwrap()
        .get(0);
    v.parse::<i32>().unwrap() / 10000
}
