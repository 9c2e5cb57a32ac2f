//! Databases of one test: a migrated database per test on a cluster, roles made with
//! docs/least-privilege.sql, and rows inserted the way producers insert them.

use super::servers::shared_pg_url;
use super::waits::eventually;
use outbox_relay::pgoutput::TableName;
use std::path::PathBuf;

/// The password of [`TestDb::least_privilege_role`]'s roles.
pub const LEAST_PRIVILEGE_PASSWORD: &str = "lp-relay-pw";

/// A database of its own on a cluster, migrated, with a slot name unique in the cluster.
pub struct TestDb {
    pub url: String,
    pub name: String,
    pub slot: String,
}

/// A row when a walsender streams from the slot `$1`: not merely `active`, which the slot also
/// is while an SQL backend creates it (`pg_create_logical_replication_slot` holds it until its
/// consistent point, and rows committed before that point are never decoded).
pub const SLOT_STREAMED: &str = "SELECT r.pid FROM pg_replication_slots s \
     JOIN pg_stat_replication r ON r.pid = s.active_pid \
     WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming')";

/// Replaces the database name of a `postgres://...` URL.
pub fn with_db(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').unwrap();
    format!("{base}/{db}")
}

impl TestDb {
    /// A new migrated database on the shared cluster.
    pub async fn new(prefix: &str) -> Self {
        Self::on(&shared_pg_url(), prefix, true).await
    }

    pub async fn on(cluster_url: &str, prefix: &str, migrate: bool) -> Self {
        let name = format!(
            "{prefix}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        let admin = connect(cluster_url).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let url = with_db(cluster_url, &name);
        if migrate {
            let mut c = connect(&url).await;
            outbox_relay::migrate::migrate(
                &mut c,
                &TableName::parse("outbox_events").unwrap(),
                "outbox_relay",
                false,
            )
            .await
            .unwrap();
        }
        Self {
            url,
            slot: format!("s_{name}"),
            name,
        }
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }

    /// The slot's confirmed_flush_lsn as a number, None without a slot.
    pub async fn confirmed_flush(&self) -> Option<u64> {
        let c = self.client().await;
        let row = c
            .query_opt(
                "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .unwrap()?;
        row.get::<_, Option<i64>>(0).map(|v| v as u64)
    }

    /// Terminates the walsender holding the slot and drops the slot before the relay can take
    /// it again (retrying until the drop wins the race).
    pub async fn drop_slot_under_relay(&self) {
        let admin = self.client().await;
        eventually("the slot is dropped", || async {
            let _ = admin
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active",
                    &[&self.slot],
                )
                .await;
            admin
                .execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
                .await
                .ok()
                .map(|_| ())
        })
        .await
    }

    /// Waits until a walsender streams from the slot (see [`SLOT_STREAMED`]).
    pub async fn wait_slot_active(&self) {
        eventually("a walsender streams from the slot", || async {
            let c = self.client().await;
            c.query_opt(SLOT_STREAMED, &[&self.slot])
                .await
                .unwrap()
                .map(|_| ())
        })
        .await
    }

    /// Waits until the slot's `active` flag is `held`.
    async fn wait_slot_held(&self, held: bool, what: &str) {
        eventually(what, || async {
            let c = self.client().await;
            let row = c
                .query_opt(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
                .unwrap()?;
            (row.get::<_, bool>(0) == held).then_some(())
        })
        .await
    }

    /// Waits until no walsender holds the slot: a relay process that exited can leave its
    /// walsender on the server for a moment, and dropping the slot then fails ("replication
    /// slot ... is active for PID n", seen under stress).
    pub async fn wait_slot_released(&self) {
        self.wait_slot_held(false, "the slot is released").await
    }

    /// The pid of the walsender holding the slot, once one other than `not` holds it: after a
    /// kill, the slot can still show the dying walsender as active for a moment, and a kill
    /// aimed at it would not land.
    pub async fn wait_walsender_other_than(&self, not: Option<i32>) -> i32 {
        eventually("a new walsender holds the slot", || async {
            let c = self.client().await;
            let row = c
                .query_opt(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND active",
                    &[&self.slot],
                )
                .await
                .unwrap()?;
            let pid: Option<i32> = row.get(0);
            pid.filter(|p| Some(*p) != not)
        })
        .await
    }

    /// A role made with exactly docs/least-privilege.sql (role, password and database names
    /// replaced), and this database as that role: the relay runs as it, while the test keeps
    /// using `self` (the owner) to insert rows and look.
    /// The name of the role [`least_privilege_role`](Self::least_privilege_role) creates.
    pub fn least_privilege_role_name(&self) -> String {
        format!("lp_{}", self.name)
    }

    pub async fn least_privilege_role(&self) -> TestDb {
        let role = self.least_privilege_role_name();
        let sql = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/least-privilege.sql"),
        )
        .unwrap();
        assert!(sql.contains("CREATE ROLE outbox_relay LOGIN REPLICATION PASSWORD 'change-me'"));
        let sql = sql
            .replace("outbox_relay", &role)
            .replace("'change-me'", &format!("'{LEAST_PRIVILEGE_PASSWORD}'"))
            .replace("DATABASE shop", &format!("DATABASE {}", self.name));
        self.client().await.batch_execute(&sql).await.unwrap();
        let (scheme, rest) = self.url.split_once("://").unwrap();
        let (_, host_and_db) = rest.split_once('@').unwrap();
        TestDb {
            url: format!("{scheme}://{role}:{LEAST_PRIVILEGE_PASSWORD}@{host_and_db}"),
            name: self.name.clone(),
            slot: self.slot.clone(),
        }
    }

    /// The current WAL position as a number.
    pub async fn current_lsn(&self) -> u64 {
        let c = self.client().await;
        let row = c
            .query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint", &[])
            .await
            .unwrap();
        row.get::<_, i64>(0) as u64
    }
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"));
    tokio::spawn(conn);
    client
}

/// Inserts `n` events in transactions of `per_txn` rows; returns their event ids in commit order.
pub async fn insert_events(
    client: &mut tokio_postgres::Client,
    name: &str,
    n: usize,
    per_txn: usize,
) -> Vec<String> {
    insert_named_events(client, &[name], n, per_txn)
        .await
        .into_iter()
        .map(|(_, id)| id)
        .collect()
}

/// Inserts `n` events whose names cycle through `names`, in transactions of `per_txn` rows (so
/// a transaction holds events of every name); returns (name, id) in commit order.
pub async fn insert_named_events(
    client: &mut tokio_postgres::Client,
    names: &[&str],
    n: usize,
    per_txn: usize,
) -> Vec<(String, String)> {
    let mut out = Vec::with_capacity(n);
    let mut left = n;
    while left > 0 {
        let k = left.min(per_txn);
        let tx = client.transaction().await.unwrap();
        let rows = tx
            .query(
                "INSERT INTO outbox_events (event_id, event_name, payload, metadata)
                 SELECT gen_random_uuid(), ($1::text[])[1 + g % cardinality($1::text[])],
                        jsonb_build_object('n', g, 'note', 'x'), '{}'
                 FROM generate_series(1, $2::int) g ORDER BY g
                 RETURNING event_name, event_id::text",
                &[&names, &(k as i32)],
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        out.extend(rows.iter().map(|r| (r.get(0), r.get(1))));
        left -= k;
    }
    out
}

/// The first column of every row `sql` returns.
pub async fn column<T>(
    client: &impl tokio_postgres::GenericClient,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Vec<T>
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    client
        .query(sql, params)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

impl TestDb {
    /// This database and its slot, reached through `url` (another role, other parameters).
    pub fn at(&self, url: impl Into<String>) -> TestDb {
        TestDb {
            url: url.into(),
            name: self.name.clone(),
            slot: self.slot.clone(),
        }
    }

    /// This database as its least-privilege role, with `password`.
    pub async fn least_privilege_role_with_password(&self, password: &str) -> TestDb {
        let role = self.least_privilege_role().await;
        let name = self.least_privilege_role_name();
        self.client()
            .await
            .batch_execute(&format!("ALTER ROLE {name} PASSWORD '{password}'"))
            .await
            .unwrap();
        role.at(role.url.replace(LEAST_PRIVILEGE_PASSWORD, password))
    }
}
