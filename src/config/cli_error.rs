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
