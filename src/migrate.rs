//! `outbox-relay migrate`: the SQL files of `migrations/`, embedded, applied in order.
//!
//! The files carry goose annotations so Go teams can apply the same files with goose; here the
//! `-- +goose Up` section of each runs in one transaction under an advisory lock. Every statement
//! is idempotent, so running it twice, or after the Go kit's own migration, changes nothing.
//! A table or publication name other than the defaults is substituted into the SQL (names are
//! validated identifiers).

use crate::command::CommandError;
use crate::config::MigrateArgs;
use crate::pgoutput::TableName;

/// The migrations, in order: (file name, SQL).
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "20240101000100_outbox_events.sql",
        include_str!("../migrations/20240101000100_outbox_events.sql"),
    ),
    (
        "20240101000200_outbox_relay_publication.sql",
        include_str!("../migrations/20240101000200_outbox_relay_publication.sql"),
    ),
    (
        "20240101000300_outbox_relay_attempts.sql",
        include_str!("../migrations/20240101000300_outbox_relay_attempts.sql"),
    ),
];

/// The optional insert trigger that wakes poll-mode relays (LISTEN/NOTIFY).
pub const NOTIFY_TRIGGER: (&str, &str) = (
    "optional/outbox_relay_notify.sql",
    include_str!("../migrations/optional/outbox_relay_notify.sql"),
);

/// An arbitrary constant: serialises concurrent `migrate` runs.
const LOCK_KEY: i64 = 0x6f75_7462_6f78;

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("migration {file} failed")]
    Sql {
        file: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("migration transaction failed")]
    Transaction(#[source] tokio_postgres::Error),
}

/// The `Up` section of a goose file, with the annotations stripped.
pub fn up_section(sql: &str) -> String {
    let mut out = String::new();
    let mut in_up = false;
    for line in sql.lines() {
        let t = line.trim();
        if t.starts_with("-- +goose Up") {
            in_up = true;
            continue;
        }
        if t.starts_with("-- +goose Down") {
            break;
        }
        if in_up && !t.starts_with("-- +goose") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The SQL of `sql` for a table and publication other than the defaults: each identifier token
/// of the default names is replaced (names are validated identifiers, so this is safe).
pub fn render(sql: &str, table: &TableName, publication: &str) -> String {
    let qualified = |name: String| match &table.schema {
        Some(schema) => format!("{schema}.{name}"),
        None => name,
    };
    let mut out = String::with_capacity(sql.len());
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        let replaced = match token.as_str() {
            "outbox_events" => table.sql(),
            "outbox_events_unpublished_idx" => format!("{}_unpublished_idx", table.table),
            // The article's name for the default table; `<table>_dead_letters` otherwise.
            "outbox_dead_letters" if table.table == "outbox_events" => qualified(token.clone()),
            "outbox_dead_letters" => qualified(format!("{}_dead_letters", table.table)),
            "outbox_relay" => publication.to_owned(),
            "outbox_relay_notify" => qualified(format!("{publication}_notify")),
            _ => std::mem::take(token),
        };
        out.push_str(&replaced);
        token.clear();
    };
    for ch in sql.chars() {
        if ch.is_ascii_alphanumeric() || ch == '_' {
            token.push(ch);
        } else {
            flush(&mut token, &mut out);
            out.push(ch);
        }
    }
    flush(&mut token, &mut out);
    out
}

/// A digest of the schema objects a migration can create or change: relations, columns and
/// their defaults, views, indexes, publications and their tables, functions and triggers. The
/// files are idempotent, so this is how `migrate` tells a file that changed something from one
/// already applied.
const CATALOG_DIGEST: &str = "
WITH ns AS (
    SELECT oid FROM pg_namespace
    WHERE nspname NOT IN ('pg_catalog', 'information_schema')
      AND nspname NOT LIKE 'pg\\_toast%' AND nspname NOT LIKE 'pg\\_temp%'
)
SELECT md5(coalesce(string_agg(x, E'\\n' ORDER BY x), '')) FROM (
    SELECT format('rel %s %s', c.oid::regclass, c.relkind) AS x
        FROM pg_class c WHERE c.relnamespace IN (SELECT oid FROM ns)
    UNION ALL
    SELECT format('col %s.%s %s %s %s', a.attrelid::regclass, a.attname,
                  format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attnum > 0 AND NOT a.attisdropped AND c.relnamespace IN (SELECT oid FROM ns)
    UNION ALL
    SELECT format('view %s %s', c.oid::regclass, pg_get_viewdef(c.oid))
        FROM pg_class c WHERE c.relkind IN ('v', 'm') AND c.relnamespace IN (SELECT oid FROM ns)
    UNION ALL
    SELECT format('index %s', pg_get_indexdef(i.indexrelid))
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relnamespace IN (SELECT oid FROM ns)
    UNION ALL
    SELECT format('pub %s %s %s %s %s', pubname, puballtables, pubinsert, pubupdate, pubdelete)
        FROM pg_publication
    UNION ALL
    SELECT format('pubrel %s %s', p.pubname, r.prrelid::regclass)
        FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
    UNION ALL
    SELECT format('fn %s %s', p.oid::regprocedure, md5(p.prosrc))
        FROM pg_proc p WHERE p.pronamespace IN (SELECT oid FROM ns)
    UNION ALL
    SELECT format('trigger %s %s %s %s', t.tgrelid::regclass, t.tgname, t.tgenabled, t.tgfoid::regprocedure)
        FROM pg_trigger t WHERE NOT t.tgisinternal
) AS catalog";

/// What `migrate` did with each file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub file: &'static str,
    /// False when the file found everything in place and changed nothing.
    pub changed: bool,
}

/// Applies every migration (and the optional notify trigger) in one transaction; says which
/// ones changed the schema and which were already applied.
pub async fn migrate(
    client: &mut tokio_postgres::Client,
    table: &TableName,
    publication: &str,
    notify_trigger: bool,
) -> Result<Vec<Applied>, MigrateError> {
    let tx = client
        .transaction()
        .await
        .map_err(MigrateError::Transaction)?;
    // The idempotent DROP ... IF EXISTS statements would log notices otherwise.
    // Producers queue behind a waiting ALTER TABLE: give up rather than block them for long.
    tx.batch_execute("SET LOCAL client_min_messages = warning; SET LOCAL lock_timeout = '10s'")
        .await
        .map_err(MigrateError::Transaction)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await
        .map_err(MigrateError::Transaction)?;
    let optional = notify_trigger.then_some(&NOTIFY_TRIGGER);
    let digest = |file: &'static str| {
        let tx = &tx;
        async move {
            let row = tx
                .query_one(CATALOG_DIGEST, &[])
                .await
                .map_err(|source| MigrateError::Sql { file, source })?;
            Ok::<String, MigrateError>(row.get(0))
        }
    };
    let mut applied = Vec::new();
    for (file, sql) in MIGRATIONS.iter().chain(optional) {
        let sql = render(&up_section(sql), table, publication);
        let before = digest(file).await?;
        tx.batch_execute(&sql)
            .await
            .map_err(|source| MigrateError::Sql { file, source })?;
        let changed = digest(file).await? != before;
        if changed {
            tracing::info!(file, "migration applied");
        } else {
            tracing::info!(file, "migration already applied: nothing to change");
        }
        applied.push(Applied { file, changed });
    }
    tx.commit().await.map_err(MigrateError::Transaction)?;
    Ok(applied)
}

/// `outbox-relay migrate`: applies the migrations, then logs what it did.
pub async fn execute(args: &MigrateArgs) -> Result<(), CommandError> {
    let mut client = args.db.target()?.connect().await?;
    let applied = migrate(
        &mut client,
        &args.db.table,
        &args.db.publication,
        args.with_notify_trigger,
    )
    .await
    .map_err(CommandError::Migrate)?;
    let changed = applied.iter().filter(|a| a.changed).count();
    tracing::info!(
        table = %args.db.table,
        publication = %args.db.publication,
        applied = changed,
        already_applied = applied.len() - changed,
        "{}",
        if changed == 0 { "schema up to date: nothing to change" } else { "migrations applied" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_sections_have_no_goose_lines_and_no_down() {
        for (_, sql) in MIGRATIONS.iter().chain([&NOTIFY_TRIGGER]) {
            let up = up_section(sql);
            assert!(!up.contains("+goose"));
            assert!(!up.contains("DROP PUBLICATION"));
            assert!(!up.trim().is_empty());
        }
    }

    #[test]
    fn render_substitutes_names() {
        let t = TableName::parse("app.events").unwrap();
        let all: String = MIGRATIONS
            .iter()
            .chain([&NOTIFY_TRIGGER])
            .map(|(_, s)| render(&up_section(s), &t, "pub_x"))
            .collect();
        assert!(all.contains("CREATE TABLE IF NOT EXISTS app.events ("));
        assert!(all.contains("events_unpublished_idx ON app.events (id)"));
        assert!(all.contains("CREATE PUBLICATION pub_x FOR TABLE app.events WITH"));
        assert!(all.contains("CREATE OR REPLACE VIEW app.events_dead_letters AS"));
        assert!(all.contains("pg_notify('pub_x', '')"));
        assert!(all.contains("FUNCTION app.pub_x_notify()"));
        assert!(!all.contains("outbox_events"));
        assert!(!all.contains("outbox_relay"));
    }
}
