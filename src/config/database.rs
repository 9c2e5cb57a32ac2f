//! Where the outbox lives: the PostgreSQL URL (or a file holding it), the table and the
//! publication.

use super::parse::{parse_identifier, parse_table};
use super::secret::Secret;
use super::ConfigError;
use crate::pgoutput::TableName;
use clap::Args;

/// Where the outbox lives.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL (postgres://user:password@host:port/dbname; sslmode, sslrootcert,
    /// sslcert and sslkey as in libpq).
    #[arg(
        long,
        env = "OUTBOX_DATABASE_URL",
        hide_env_values = true,
        required_unless_present = "database_url_file",
        conflicts_with = "database_url_file",
        value_parser = Secret::value_parser()
    )]
    pub database_url: Option<Secret>,
    /// A file holding the PostgreSQL URL instead (a mounted secret; a trailing newline is
    /// ignored).
    #[arg(long, env = "OUTBOX_DATABASE_URL_FILE", value_name = "PATH", value_parser = Secret::file_parser())]
    pub database_url_file: Option<Secret>,
    /// The outbox table, `table` or `schema.table`.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox_events", value_parser = parse_table)]
    pub table: TableName,
    /// The publication the slot streams (created when missing; inserts only).
    #[arg(long, env = "OUTBOX_PUBLICATION", default_value = "outbox_relay", value_parser = parse_identifier)]
    pub publication: String,
}

impl DatabaseArgs {
    /// The database URL, from OUTBOX_DATABASE_URL or the file of OUTBOX_DATABASE_URL_FILE (may
    /// contain a password: never log it).
    pub fn url(&self) -> &str {
        self.url_secret().map_or("", Secret::value)
    }

    /// The parsed database URL.
    pub fn target(&self) -> Result<crate::postgres::PgTarget, ConfigError> {
        let setting = self
            .url_secret()
            .map_or("OUTBOX_DATABASE_URL", Secret::setting);
        crate::postgres::PgTarget::parse(self.url()).map_err(|e| ConfigError::Invalid {
            setting: setting.to_owned(),
            reason: e.to_string(),
        })
    }

    fn url_secret(&self) -> Option<&Secret> {
        Secret::either(&self.database_url, &self.database_url_file)
    }
}
