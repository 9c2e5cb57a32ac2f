//! Keeps bench/mark_cost.py measuring the statements the relay sends.
//!
//! The script holds copies of the marking statements of `Store::mark_delivered_returning` as
//! the Python strings `UPDATE` and `DELETE` (psycopg `%s` placeholders, table
//! `outbox_events`); each must equal [`mark_delivered_sql`] for that table once its first `%s`
//! becomes `$1` and its second `$2`.
//!
//! No servers: the script is read as text.

use outbox_relay::store::mark_delivered_sql;
use std::path::PathBuf;

const SCRIPT: &str = "bench/mark_cost.py";

fn read(relative: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// The value of the module-level `NAME = ("..." "..." ...)` in `script`: the adjacent
/// double-quoted literals inside the parentheses, joined. Only the plain literals the script
/// uses are understood; anything else (an escape, a single quote, an f-string) panics.
fn python_string(script: &str, name: &str) -> String {
    let head = format!("\n{name} = (");
    let start = script
        .find(&head)
        .map(|at| at + head.len())
        .unwrap_or_else(|| panic!("{SCRIPT}: no line starting with `{}`", &head[1..]));
    let mut out = String::new();
    let mut chars = script[start..].chars();
    loop {
        match chars.next() {
            Some(')') => break,
            Some(c) if c.is_whitespace() => {}
            Some('"') => loop {
                match chars.next() {
                    Some('"') => break,
                    Some('\\') => {
                        panic!("{SCRIPT}: {name} has an escape, which this test cannot read")
                    }
                    Some('\n') | None => panic!("{SCRIPT}: {name} has an unterminated literal"),
                    Some(c) => out.push(c),
                }
            },
            Some(c) => panic!("{SCRIPT}: {name} holds {c:?} outside a \"...\" literal"),
            None => panic!("{SCRIPT}: {name} has no closing parenthesis"),
        }
    }
    assert!(!out.is_empty(), "{SCRIPT}: {name} is empty");
    out
}

/// `sql` with its first `%s` as `$1` and its second as `$2`; exactly two are expected.
fn numbered(sql: &str, name: &str) -> String {
    let parts: Vec<&str> = sql.split("%s").collect();
    assert_eq!(
        parts.len(),
        3,
        "{SCRIPT}: {name} has {} `%s` placeholders, 2 expected: {sql}",
        parts.len() - 1
    );
    format!("{}$1{}$2{}", parts[0], parts[1], parts[2])
}

#[test]
fn mark_cost_py_measures_the_relays_marking_statements() {
    let script = read(SCRIPT);
    for (name, delete_delivered) in [("UPDATE", false), ("DELETE", true)] {
        let copy = numbered(&python_string(&script, name), name);
        let relay = mark_delivered_sql("outbox_events", delete_delivered);
        assert!(
            copy == relay,
            "{SCRIPT}'s {name} differs from the statement the relay sends \
             (src/store/statements.rs, mark_delivered_sql(\"outbox_events\", {delete_delivered})); \
             copy the relay's into the script, `$1`/`$2` as `%s`:\n  \
             script ({name}): {copy}\n  relay:  {relay}"
        );
    }
}
