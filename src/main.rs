//! The `outbox-relay` binary: parse the CLI, set up logging, hand the command to its module,
//! map errors to exit codes (0 success or clean shutdown, 1 runtime failure, 2 bad
//! configuration).

use clap::{CommandFactory, FromArgMatches};
use outbox_relay::command::{print, CommandError};
use outbox_relay::config::cli_error::naming_the_env_var;
use outbox_relay::config::log::log_filter;
use outbox_relay::config::secret::secrets_on_command_line;
use outbox_relay::config::{Cli, Command, LogFormat};
use outbox_relay::error_chain;
use outbox_relay::operator::fail_on_refused;
use outbox_relay::{admin, daemon, inspect, migrate, status};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cmd = Cli::command();
    let parsed = cmd
        .clone()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{}", naming_the_env_var(&e));
            return ExitCode::from(2);
        }
    };
    if let Err(e) = cli.command.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let filter = log_filter(
        std::env::var("OUTBOX_LOG").ok().as_deref(),
        std::env::var("RUST_LOG").ok().as_deref(),
    );
    match filter {
        Ok(filter) => init_tracing(cli.log_format, &filter),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    for (flag, instead) in secrets_on_command_line(&cmd, &matches) {
        tracing::warn!(
            "{flag} carries a secret on the command line, where every user of this host can \
             read it (ps, /proc); set {instead} instead (docs/configuration.md#secrets)"
        );
    }
    let runtime = match runtime(cli.worker_threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(&cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once: `run` is a daemon whose output is its log; the other commands end with the
            // one line a person reads.
            if matches!(cli.command, Command::Run(_)) {
                tracing::error!(error = %error_chain(&e), "outbox-relay failed");
            } else {
                eprintln!("error: {}", error_chain(&e));
            }
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: &Command) -> Result<(), CommandError> {
    match command {
        Command::Run(args) => daemon::execute(args).await,
        Command::Migrate(args) => migrate::execute(args).await,
        Command::Peek(args) => inspect::execute(args).await,
        Command::DeadLetters(cmd) => admin::execute_dead_letters(cmd).await,
        Command::Cleanup(args) => admin::execute_cleanup(args).await,
        Command::Status(args) => status::execute(args).await,
        Command::Trace(args) => {
            let traces = outbox_relay::trace::trace(args).await?;
            print(args.json, &traces[..], outbox_relay::trace::render)
        }
        Command::Replay(args) => {
            let report = outbox_relay::replay::replay(args).await?;
            print(args.json, &report, outbox_relay::replay::render)?;
            Ok(fail_on_refused(&report.refused)?)
        }
        Command::Reconcile(args) => {
            let report = outbox_relay::reconcile::reconcile(args).await?;
            print(args.json, &report, outbox_relay::reconcile::render)?;
            Ok(fail_on_refused(&report.refused)?)
        }
    }
}

/// 0 worker threads: everything on the main thread (the default); otherwise a thread pool.
fn runtime(worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = if worker_threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(worker_threads);
        b
    };
    builder.enable_all().build()
}

/// `spec` was checked by [`log_filter`].
fn init_tracing(format: LogFormat, spec: &str) {
    let mut filter = tracing_subscriber::EnvFilter::new(spec);
    // pgwire-replication logs every replication connection that ends with an error at ERROR,
    // and returns that error to the relay, which logs it at the level it deserves: a standby
    // replica retrying a slot in use every second is not an error. Silenced unless the filter
    // names the crate.
    if !spec.contains("pgwire_replication") {
        if let Ok(d) = "pgwire_replication::client::tokio_client=off".parse() {
            filter = filter.add_directive(d);
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
