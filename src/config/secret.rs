//! Settings that carry secrets: one [`Secret`] type for every setting given either as a value
//! or as a file holding it (`X` and `X_FILE`, a mounted secret), and [`redact_url`] for
//! messages that name a server.
//!
//! Both halves of a pair parse to a `Secret` that remembers the setting it came from (for
//! messages) and never shows its value; clap refuses a pair given both ways.

use clap::builder::{StringValueParser, TypedValueParser};
use std::ffi::OsStr;
use std::path::PathBuf;

/// A secret setting's value, and where it came from. Its `Debug` never shows the value.
#[derive(Clone)]
pub struct Secret {
    value: String,
    /// The setting's environment variable (or flag), named in messages.
    setting: String,
    /// The file the value was read from (`*_FILE` settings).
    file: Option<PathBuf>,
}

impl Secret {
    /// A value given directly as `setting`.
    pub fn given(setting: &str, value: impl Into<String>) -> Self {
        Self {
            value: value.into(),
            setting: setting.to_owned(),
            file: None,
        }
    }

    /// The secret itself (never log it).
    pub fn value(&self) -> &str {
        &self.value
    }

    /// The setting it came from, e.g. `OUTBOX_DATABASE_URL_FILE`.
    pub fn setting(&self) -> &str {
        &self.setting
    }

    /// The value of a value-or-file pair: the value when given, else the file's contents (clap
    /// refuses both).
    pub fn either<'a>(given: &'a Option<Secret>, file: &'a Option<Secret>) -> Option<&'a Secret> {
        given.as_ref().or(file.as_ref())
    }

    /// clap's parser of a secret given as a value.
    pub fn value_parser() -> SecretParser {
        SecretParser { from_file: false }
    }

    /// clap's parser of a `*_FILE` setting: the file is read when the command line is parsed,
    /// so an unreadable file is a configuration error (exit code 2) naming the setting.
    pub fn file_parser() -> SecretParser {
        SecretParser { from_file: true }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.file {
            Some(path) => write!(f, "Secret({} from {})", self.setting, path.display()),
            None => write!(f, "Secret({})", self.setting),
        }
    }
}

/// Parses one half of a value-or-file pair into a [`Secret`] named after the argument's
/// environment variable (or its flag).
#[derive(Debug, Clone, Copy)]
pub struct SecretParser {
    from_file: bool,
}

impl TypedValueParser for SecretParser {
    type Value = Secret;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<Secret, clap::Error> {
        let setting = arg.map(setting_name).unwrap_or_default();
        if self.from_file {
            let (path, value) = read_secret_file.parse_ref(cmd, arg, value)?;
            Ok(Secret {
                value,
                setting,
                file: Some(path),
            })
        } else {
            let value = StringValueParser::new().parse_ref(cmd, arg, value)?;
            Ok(Secret::given(&setting, value))
        }
    }
}

/// The name messages give a setting: its environment variable, or its flag when it has none
/// (a command line built without environment lookups).
fn setting_name(arg: &clap::Arg) -> String {
    match (arg.get_env(), arg.get_long()) {
        (Some(env), _) => env.to_string_lossy().into_owned(),
        (None, Some(long)) => format!("--{long}"),
        (None, None) => arg.get_id().to_string(),
    }
}

/// A `*_FILE` setting's file: its contents with trailing line breaks removed. The message never
/// quotes the contents.
fn read_secret_file(path: &str) -> Result<(PathBuf, String), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let text = String::from_utf8(bytes).map_err(|_| format!("{path} is not UTF-8 text"))?;
    let value = text.trim_end_matches(['\n', '\r']).to_owned();
    if value.is_empty() {
        return Err(format!("{path} is empty"));
    }
    Ok((PathBuf::from(path), value))
}

/// The long flags that carry a secret (a password, or a URL that may hold one). On the command
/// line they are visible to every user of the host (`ps`, `/proc/<pid>/cmdline`).
pub const SECRET_FLAGS: &[&str] = &[
    "database-url",
    "valkey-url",
    "valkey-password",
    "valkey-sentinel-password",
    "replication-url",
];

/// The secret flags `matches` got from the command line itself (not from their variables), in
/// `cmd` and the subcommand that ran, each with the variables to use instead:
/// `("--database-url", "OUTBOX_DATABASE_URL or OUTBOX_DATABASE_URL_FILE")`.
pub fn secrets_on_command_line(
    cmd: &clap::Command,
    matches: &clap::ArgMatches,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long().filter(|l| SECRET_FLAGS.contains(l)) else {
            continue;
        };
        if matches.value_source(arg.get_id().as_str())
            == Some(clap::parser::ValueSource::CommandLine)
        {
            let env = arg
                .get_env()
                .map_or(String::new(), |e| e.to_string_lossy().into_owned());
            let file = format!("{env}_FILE");
            let has_file = cmd
                .get_arguments()
                .any(|a| a.get_env().is_some_and(|e| e == file.as_str()));
            let instead = if has_file {
                format!("{env} or {file}")
            } else {
                env
            };
            out.push((format!("--{long}"), instead));
        }
    }
    if let Some((name, sub_matches)) = matches.subcommand() {
        if let Some(sub) = cmd.find_subcommand(name) {
            out.extend(secrets_on_command_line(sub, sub_matches));
        }
    }
    out
}

/// A URL with its password replaced by `***`, for messages: the password of the authority,
/// and the `pass`/`password` query parameters (Unix-socket URLs carry it there).
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            let secret = |k: &str| matches!(k, "pass" | "password");
            if u.query_pairs().any(|(k, _)| secret(&k)) {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if secret(&k) {
                            "***".into()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            u.to_string()
        }
        Err(_) => "<unparseable url>".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value() {
        let s = Secret::given("OUTBOX_DATABASE_URL", "postgres://u:hunter2@h/d");
        assert_eq!(format!("{s:?}"), "Secret(OUTBOX_DATABASE_URL)");
        assert_eq!(s.value(), "postgres://u:hunter2@h/d");
    }

    #[test]
    fn files_lose_trailing_line_breaks_and_must_not_be_empty() {
        let dir = std::env::temp_dir().join(format!("secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "s3cret\r\n\n").unwrap();
        let (_, value) = read_secret_file(file.to_str().unwrap()).unwrap();
        assert_eq!(value, "s3cret");
        std::fs::write(&file, "\n").unwrap();
        let err = read_secret_file(file.to_str().unwrap()).unwrap_err();
        assert!(err.ends_with("is empty"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_secret_is_named_after_its_variable_or_else_its_flag() {
        use clap::{Arg, Command};
        let parse = |arg: Arg| {
            let m = Command::new("t")
                .arg(arg.value_parser(Secret::value_parser()))
                .try_get_matches_from(["t", "--pw", "x"])
                .unwrap();
            m.get_one::<Secret>("pw").unwrap().setting().to_owned()
        };
        assert_eq!(parse(Arg::new("pw").long("pw").env("T_PW")), "T_PW");
        assert_eq!(parse(Arg::new("pw").long("pw")), "--pw");
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact_url("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(
            redact_url("redis+unix:///run/valkey.sock?db=2&pass=secret"),
            "redis+unix:///run/valkey.sock?db=2&pass=***"
        );
    }

    #[test]
    fn secret_flags_on_the_command_line_are_found_but_not_their_variables() {
        use clap::CommandFactory;
        let cmd = crate::config::Cli::command();
        let m = cmd
            .clone()
            .try_get_matches_from([
                "outbox-relay",
                "dead-letters",
                "list",
                "--database-url=postgres://u:pw@h/d",
            ])
            .unwrap();
        assert_eq!(
            secrets_on_command_line(&cmd, &m),
            [(
                "--database-url".to_owned(),
                "OUTBOX_DATABASE_URL or OUTBOX_DATABASE_URL_FILE".to_owned()
            )]
        );
        let m = cmd
            .clone()
            .try_get_matches_from([
                "outbox-relay",
                "peek",
                "--valkey-password",
                "pw",
                "--queue",
                "q",
            ])
            .unwrap();
        assert_eq!(secrets_on_command_line(&cmd, &m).len(), 1);
        let m = cmd
            .clone()
            .try_get_matches_from(["outbox-relay", "peek", "--valkey-addr", "h:1"])
            .unwrap();
        assert!(secrets_on_command_line(&cmd, &m).is_empty());
    }
}
