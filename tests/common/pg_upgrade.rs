//! Major-version upgrades as an operator runs them: the full PostgreSQL installs that
//! scripts/fetch-postgres-full.sh pins (`OUTBOX_TEST_PG_FULL_<MAJOR>`, exported by
//! `scripts/test.sh --upgrade`), a cluster of one test run from a chosen install, and the
//! `upgrade` and `upgraded` blocks of docs/operations.md run as written.
//!
//! The shell blocks run with bash as the `postgres` OS user when the tests run as root (the
//! owner of both data directories, as pg_upgrade requires), from a directory of their own
//! (pg_upgrade puts its sockets and files in the current directory).

use super::runbook_blocks::{blocks, operations_doc, Block, UPGRADE_SERVERS};
use super::{connect, script_env, scripts, tmp_dir};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// The bin dir of the full install of `major`, or why there is none.
fn full_install(major: i32) -> Result<PathBuf, String> {
    let var = format!("OUTBOX_TEST_PG_FULL_{major}");
    let dir = std::env::var_os(&var).map(PathBuf::from).ok_or_else(|| {
        format!("{var} is unset (scripts/test.sh --upgrade fetches the full installs)")
    })?;
    for tool in [
        "pg_upgrade",
        "pg_resetwal",
        "pg_controldata",
        "pg_ctl",
        "postgres",
    ] {
        if !dir.join(tool).is_file() {
            return Err(format!("{var}={} has no {tool}", dir.display()));
        }
    }
    Ok(dir)
}

/// The bin dirs of the full installs of `majors`, in that order; None, after saying why on
/// the terminal, when one is missing: the test then skips. Written to the process's stderr
/// directly, so the reason shows even where the test harness captures a test's output.
pub fn full_installs_or_skip(test: &str, majors: &[i32]) -> Option<Vec<PathBuf>> {
    match majors
        .iter()
        .map(|m| full_install(*m))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(dirs) => Some(dirs),
        Err(reason) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {reason}");
            None
        }
    }
}

fn is_root() -> bool {
    let out = std::process::Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

/// Makes `dir` the `postgres` user's when we are root (pg_upgrade and initdb write there).
fn give_to_postgres(dir: &Path) {
    if is_root() {
        let ok = std::process::Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(ok.success(), "chown postgres {dir:?}");
    }
}

/// A cluster of this test run from the install in `bindir`, started and stopped by the
/// project's scripts (on a free loopback port, with their test settings).
pub struct Cluster {
    dir: PathBuf,
    pub bindir: PathBuf,
    pub url: String,
    pub port: u16,
}

impl Cluster {
    /// initdb and start.
    pub fn start(bindir: &Path) -> Self {
        Self::start_in(tmp_dir("pg-upgrade"), bindir, None)
    }

    /// Starts the cluster in `dir` (initdb unless `dir/data` holds one), on `port` if given.
    fn start_in(dir: PathBuf, bindir: &Path, port: Option<u16>) -> Self {
        let port_arg = port.map(|p| p.to_string());
        let mut args = vec![dir.to_str().unwrap()];
        args.extend(port_arg.as_deref());
        let url = script_env(
            "pg-start.sh",
            &args,
            &[("OUTBOX_TEST_PG_BINDIR", bindir_str(bindir))],
        );
        let port = std::fs::read_to_string(dir.join("port"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        Self {
            dir,
            bindir: bindir.to_owned(),
            url,
            port,
        }
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Whether its postmaster runs: the pid in postmaster.pid is alive (a clean stop removes
    /// the file; pg_ctl itself refuses to run as root).
    pub fn running(&self) -> bool {
        std::fs::read_to_string(self.data_dir().join("postmaster.pid"))
            .ok()
            .and_then(|text| text.lines().next().map(|l| l.trim().to_owned()))
            .is_some_and(|pid| Path::new("/proc").join(pid).exists())
    }
}

fn bindir_str(dir: &Path) -> &str {
    dir.to_str().expect("a UTF-8 bin dir")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(scripts().join("pg-stop.sh"))
            .arg(&self.dir)
            .arg("immediate")
            .env("OUTBOX_TEST_PG_BINDIR", &self.bindir)
            .stderr(Stdio::null())
            .status();
    }
}

/// One upgrade of `old` to the install in `new_bindir`, by the runbook's blocks.
pub struct UpgradeRun<'a> {
    old: &'a Cluster,
    old_major: i32,
    new_bindir: PathBuf,
    /// The new cluster's directory (its data directory is `data` in it).
    new_dir: PathBuf,
    /// The blocks' current directory.
    work: PathBuf,
    /// The `upgrade` and `upgraded` blocks, in the runbook's order.
    blocks: Vec<Block>,
    next: usize,
}

impl<'a> UpgradeRun<'a> {
    pub async fn new(old: &'a Cluster, new_bindir: &Path) -> Self {
        let old_major = super::pg_standby::server_major(&connect(&old.url).await).await;
        let blocks: Vec<Block> = blocks(&operations_doc())
            .into_iter()
            .filter(|b| UPGRADE_SERVERS.contains(&b.server.as_str()))
            .filter(|b| old_major >= b.min_major)
            .collect();
        assert!(
            blocks
                .iter()
                .any(|b| b.text.contains("pg_upgrade\" --check")),
            "the runbook's upgrade blocks run pg_upgrade --check"
        );
        let (new_dir, work) = (tmp_dir("pg-upgraded"), tmp_dir("pg-upgrade-work"));
        give_to_postgres(&new_dir);
        give_to_postgres(&work);
        Self {
            old,
            old_major,
            new_bindir: new_bindir.to_owned(),
            new_dir,
            work,
            blocks,
            next: 0,
        }
    }

    /// Runs the shell blocks up to the one that stops the old cluster (the first after which it
    /// no longer runs); panics if none does.
    pub fn stop_old(&mut self) {
        while self.old.running() {
            let block = self.next_block("upgrade");
            self.run_shell(&block);
        }
    }

    /// Runs the remaining shell blocks (the new cluster, `pg_upgrade --check`, the upgrade),
    /// then starts the new cluster on the old one's port, so its clients' URLs stay the same.
    pub fn upgrade(&mut self) -> Cluster {
        assert!(!self.old.running(), "stop_old first");
        while self
            .blocks
            .get(self.next)
            .is_some_and(|b| b.server == "upgrade")
        {
            let block = self.next_block("upgrade");
            self.run_shell(&block);
        }
        Cluster::start_in(self.new_dir.clone(), &self.new_bindir, Some(self.old.port))
    }

    /// Runs the `upgraded` blocks on `url` (the upgraded cluster's database); each must return
    /// a row. Returns how many ran (blocks for later old versions are left out).
    pub async fn check_upgraded(&mut self, url: &str) -> usize {
        let client = connect(url).await;
        let mut ran = 0;
        while self.next < self.blocks.len() {
            let block = self.next_block("upgraded");
            let rows = client
                .simple_query(&block.text)
                .await
                .unwrap_or_else(|e| panic!("{}: {e:?}", block.place()));
            assert!(
                rows.iter()
                    .any(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_))),
                "{}: no row after the upgrade from {}",
                block.place(),
                self.old_major
            );
            ran += 1;
        }
        ran
    }

    fn next_block(&mut self, server: &str) -> Block {
        let Some(block) = self.blocks.get(self.next).cloned() else {
            panic!("the runbook has no more {server} blocks");
        };
        assert_eq!(block.server, server, "{}: out of order", block.place());
        self.next += 1;
        block
    }

    fn run_shell(&self, block: &Block) {
        assert_eq!(
            block.lang,
            "sh",
            "{}: upgrade blocks are shell",
            block.place()
        );
        let mut cmd = if is_root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--", "bash"]);
            c
        } else {
            std::process::Command::new("bash")
        };
        let out = cmd
            .args(["-euo", "pipefail", "-c", &block.text])
            .current_dir(&self.work)
            .env("OLD_BINDIR", &self.old.bindir)
            .env("NEW_BINDIR", &self.new_bindir)
            .env("OLD_DATA", self.old.data_dir())
            .env("NEW_DATA", self.new_dir.join("data"))
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{}:\n{text}", block.place());
        assert!(
            out.status.success(),
            "{}: the upgrade block failed: {text}\n{}",
            block.place(),
            self.pg_upgrade_logs()
        );
    }

    /// The logs pg_upgrade leaves in the new data directory when it fails.
    fn pg_upgrade_logs(&self) -> String {
        let mut out = String::new();
        let root = self.new_dir.join("data/pg_upgrade_output.d");
        let mut stack = vec![root];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                } else if let Ok(text) = std::fs::read_to_string(&path) {
                    let tail: Vec<&str> = text.lines().rev().take(30).collect();
                    out.push_str(&format!("--- {}\n", path.display()));
                    for line in tail.iter().rev() {
                        out.push_str(line);
                        out.push('\n');
                    }
                }
            }
        }
        out
    }
}
