//! The marked blocks of docs/operations.md: each SQL and shell block carries a comment
//! `<!-- runbook: SERVER[, N+][, wait] -->` just above it, and the tests run them as written.
//!
//! SERVER says where a block runs: `primary`, `standby`, `new primary` (the standby once
//! promoted), `old primary` and `shell` (bash, `$PRIMARY_URL` and `$STANDBY_URL` set) are
//! tests/runbook.rs's; `upgrade` (bash as the `postgres` OS user, `$OLD_BINDIR`, `$NEW_BINDIR`,
//! `$OLD_DATA` and `$NEW_DATA` set) and `upgraded` (SQL on the upgraded cluster) are
//! tests/upgrade.rs's. `N+` skips a block before version N (for the upgrade blocks, the old
//! cluster's); `wait` repeats it until it returns a row. A block without the comment fails
//! both tests, so the runbook cannot hold a command that was never run.

/// The servers a block can name.
const SERVERS: &[&str] = &[
    "primary",
    "standby",
    "new primary",
    "old primary",
    "shell",
    "upgrade",
    "upgraded",
];

/// The servers whose blocks tests/upgrade.rs runs (tests/runbook.rs leaves them).
pub const UPGRADE_SERVERS: &[&str] = &["upgrade", "upgraded"];

#[derive(Debug, Clone)]
pub struct Block {
    /// Its line in docs/operations.md (the opening fence), for messages.
    pub line: usize,
    /// `sql` or `sh`.
    pub lang: String,
    pub server: String,
    /// Skipped on servers (for upgrades, old clusters) older than this major.
    pub min_major: i32,
    /// Repeated until it returns a row.
    pub wait: bool,
    pub text: String,
}

impl Block {
    /// Where it is, for assertion messages.
    pub fn place(&self) -> String {
        format!("docs/operations.md line {}", self.line)
    }

    /// Its statements one at a time, as psql sends them (ALTER SYSTEM refuses a transaction).
    pub fn statements(&self) -> impl Iterator<Item = &str> {
        self.text
            .split(";\n")
            .map(str::trim)
            .filter(|s| !s.is_empty())
    }
}

/// docs/operations.md as the tests read it.
pub fn operations_doc() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md")).unwrap()
}

/// Every SQL and shell block of `doc`, in order; panics on a block without its comment.
pub fn blocks(doc: &str) -> Vec<Block> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        let Some(lang) = line
            .strip_prefix("```")
            .filter(|l| matches!(*l, "sql" | "sh"))
        else {
            i += 1;
            continue;
        };
        let note = (i > 0)
            .then(|| lines[i - 1].trim())
            .and_then(|l| l.strip_prefix("<!-- runbook:"))
            .and_then(|l| l.strip_suffix("-->"))
            .unwrap_or_else(|| {
                panic!(
                    "docs/operations.md line {}: a {lang} block without a `<!-- runbook: ... -->` comment",
                    i + 1
                )
            });
        let mut block = Block {
            line: i + 1,
            lang: lang.to_owned(),
            server: String::new(),
            min_major: 0,
            wait: false,
            text: String::new(),
        };
        for word in note.split(',').map(str::trim) {
            if word == "wait" {
                block.wait = true;
            } else if let Some(v) = word.strip_suffix('+') {
                block.min_major = v.parse().expect("a version like 17+");
            } else if block.server.is_empty() {
                block.server = word.to_owned();
            }
        }
        assert!(
            SERVERS.contains(&block.server.as_str()),
            "{}: unknown server {:?}",
            block.place(),
            block.server
        );
        i += 1;
        while i < lines.len() && lines[i].trim() != "```" {
            block.text.push_str(lines[i]);
            block.text.push('\n');
            i += 1;
        }
        out.push(block);
        i += 1;
    }
    out
}
