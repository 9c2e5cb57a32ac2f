//! clap's error messages with the environment variable of the offending setting named too, on
//! one line: most deployments set `OUTBOX_*` variables, not flags.

use super::cli::Cli;
use clap::error::{ContextKind, ContextValue, ErrorKind};

/// clap's error, with the environment variable of the offending flag named too.
pub fn naming_the_env_var(e: &clap::Error) -> String {
    let text = e.render().to_string();
    // The offending argument(s): one, a conflicting pair, or the missing ones.
    let mut args: Vec<String> = Vec::new();
    for kind in [ContextKind::InvalidArg, ContextKind::PriorArg] {
        match e.get(kind) {
            Some(ContextValue::String(a)) => args.push(a.clone()),
            Some(ContextValue::Strings(list)) => args.extend(list.iter().cloned()),
            _ => {}
        }
    }
    let cmd = <Cli as clap::CommandFactory>::command();
    let envs: Vec<String> = args.iter().filter_map(|a| env_of(&cmd, a)).collect();
    if envs.is_empty() {
        return text;
    }
    let first = text.lines().next().unwrap_or("");
    let named = match envs.as_slice() {
        [one] => format!("environment variable {one}"),
        many => format!("environment variables {}", many.join(", ")),
    };
    if e.kind() == ErrorKind::MissingRequiredArgument {
        // clap lists the missing arguments on lines of their own: keep it to one line.
        format!("{first} {} ({named})", args.join(", "))
    } else if let Some(ContextValue::Strings(valid)) = e.get(ContextKind::ValidValue) {
        // A refused choice: clap lists the valid ones on a line of their own.
        format!("{first} ({named}; possible values: {})", valid.join(", "))
    } else {
        format!("{first} ({named})")
    }
}

/// The environment variable of an argument as clap names it (`--database-url <URL>`), looked up
/// in `cmd` and its subcommands.
fn env_of(cmd: &clap::Command, arg: &str) -> Option<String> {
    let long = arg
        .split_whitespace()
        .next()
        .unwrap_or("")
        .trim_start_matches("--");
    std::iter::once(cmd)
        .chain(cmd.get_subcommands())
        .flat_map(|c| c.get_arguments())
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn error_of(args: &[&str]) -> String {
        let e = Cli::try_parse_from(args).expect_err("should be refused");
        naming_the_env_var(&e)
    }

    #[test]
    fn a_refused_choice_lists_the_valid_ones() {
        let e = error_of(&["outbox-relay", "--log-format", "yaml", "peek"]);
        assert!(e.contains("OUTBOX_LOG_FORMAT"), "{e}");
        assert!(e.contains("possible values: text, json"), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }

    #[test]
    fn retry_without_a_choice_names_both() {
        let e = error_of(&["outbox-relay", "dead-letters", "retry"]);
        assert!(e.contains("--all") && e.contains("--event-id"), "{e}");
    }

    #[test]
    fn an_event_id_must_be_a_uuid() {
        let e = error_of(&[
            "outbox-relay",
            "dead-letters",
            "retry",
            "--database-url",
            "postgres://h/d",
            "--event-id",
            "42",
        ]);
        assert!(e.contains("\"42\" is not an event id"), "{e}");
    }
}
