//! What a Valkey restart would lose. asynq keeps tasks only in Valkey: a task the relay wrote
//! and acknowledged to Postgres (the row marked published, the slot moved on) is never sent
//! again. A Valkey that restarts without AOF loses every task written since its last RDB
//! snapshot; one with no replica has nothing to fail over to. `run` warns at start when both
//! are missing (on a cluster, per primary); docs/operations.md says what each setting means,
//! and `outbox-relay reconcile` finds and heals such losses.

use crate::valkey::ValkeyConnection;

/// One primary's persistence and replication, from `INFO`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Durability {
    /// The cluster node, `None` outside a cluster.
    pub node: Option<String>,
    /// `appendonly yes`.
    pub aof_enabled: bool,
    /// Replicas connected now.
    pub connected_replicas: u32,
    /// Writes since the last RDB snapshot (`rdb_changes_since_last_save`): what a restart
    /// without AOF would lose now.
    pub changes_since_last_save: u64,
}

impl Durability {
    /// Neither an append-only file nor a replica: a restart loses acknowledged tasks.
    pub fn volatile(&self) -> bool {
        !self.aof_enabled && self.connected_replicas == 0
    }
}

/// The `field` of an `INFO` reply.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        l.trim_end()
            .strip_prefix(field)
            .and_then(|rest| rest.strip_prefix(':'))
    })
}

/// Parses the persistence and replication sections of `INFO`.
pub fn parse(node: Option<String>, persistence: &str, replication: &str) -> Durability {
    let num = |info: &str, f: &str| info_field(info, f).and_then(|v| v.parse::<u64>().ok());
    Durability {
        node,
        aof_enabled: info_field(persistence, "aof_enabled") == Some("1"),
        connected_replicas: num(replication, "connected_slaves").unwrap_or(0) as u32,
        changes_since_last_save: num(persistence, "rdb_changes_since_last_save").unwrap_or(0),
    }
}

/// Asks every primary.
pub async fn check(conn: &ValkeyConnection) -> redis::RedisResult<Vec<Durability>> {
    let mut conn = conn.clone();
    let mut persistence = redis::cmd("INFO");
    persistence.arg("persistence");
    let mut replication = redis::cmd("INFO");
    replication.arg("replication");
    let p = conn.on_each_primary::<String>(&persistence).await?;
    let r = conn.on_each_primary::<String>(&replication).await?;
    let mut out = Vec::new();
    for (node, reply) in p {
        let Ok(pinfo) = reply else { continue };
        let rinfo = r
            .iter()
            .find(|(n, _)| *n == node)
            .and_then(|(_, reply)| reply.as_ref().ok())
            .cloned()
            .unwrap_or_default();
        out.push(parse(node, &pinfo, &rinfo));
    }
    Ok(out)
}

/// Logs a warning for each primary that runs without AOF and without replicas.
/// With `waits_for_replicas` false, a primary with replicas is also told about (at info level):
/// they are asynchronous, and a failover may lose the writes the relay counted last (found by
/// review: such a setup got no word at all).
pub async fn warn_if_volatile(conn: &ValkeyConnection, waits_for_replicas: bool) {
    let found = match check(conn).await {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "could not read valkey persistence");
            return;
        }
    };
    for d in found.iter().filter(|d| d.volatile()) {
        tracing::warn!(
            node = d.node.as_deref().unwrap_or("-"),
            "valkey runs without AOF (appendonly) and without replicas: a restart loses the \
             tasks written since its last snapshot, and the relay does not send acknowledged \
             events again; enable appendonly, and after a loss run `outbox-relay reconcile \
             --since <time before the restart>` (docs/operations.md, operator commands)"
        );
    }
    if waits_for_replicas {
        return;
    }
    for d in found.iter().filter(|d| d.connected_replicas > 0) {
        tracing::info!(
            node = d.node.as_deref().unwrap_or("-"),
            replicas = d.connected_replicas,
            "valkey replicates asynchronously: a failover may lose the last writes the relay \
             counted as delivered; OUTBOX_VALKEY_WAIT_REPLICAS makes each write wait for \
             replicas (one server or sentinels)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_info() {
        let d = parse(
            None,
            "# Persistence\r\nloading:0\r\nrdb_changes_since_last_save:12\r\naof_enabled:0\r\n",
            "# Replication\r\nrole:master\r\nconnected_slaves:0\r\n",
        );
        assert!(d.volatile());
        assert_eq!(d.changes_since_last_save, 12);
        let d = parse(None, "aof_enabled:1\r\n", "connected_slaves:0\r\n");
        assert!(!d.volatile());
        let d = parse(None, "aof_enabled:0\r\n", "connected_slaves:2\r\n");
        assert!(!d.volatile());
        assert_eq!(d.connected_replicas, 2);
    }
}
