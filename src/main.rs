//! The `outbox-relay` binary: parse the CLI, set up logging, hand the command to its module,
//! map errors to exit codes (0 success or clean shutdown, 1 runtime failure, 2 bad
//! configuration).

use clap::Parser;
use outbox_relay::command::{print, CommandError};
use outbox_relay::config::cli_error::naming_the_env_var;
use outbox_relay::config::{Cli, Command, LogFormat};
use outbox_relay::error_chain;
use outbox_relay::{admin, daemon, inspect, migrate, status};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
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
    init_tracing(cli.log_format);
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
            tracing::error!(error = %error_chain(&e), "outbox-relay failed");
            eprintln!("error: {}", error_chain(&e));
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
            print(args.json, &report, outbox_relay::replay::render)
        }
        Command::Reconcile(args) => {
            let report = outbox_relay::reconcile::reconcile(args).await?;
            print(args.json, &report, outbox_relay::reconcile::render)
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

fn init_tracing(format: LogFormat) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // pgwire-replication logs every replication connection that ends with an error at ERROR,
    // and returns that error to the relay, which logs it at the level it deserves: a standby
    // replica retrying a slot in use every second is not an error. Silenced unless OUTBOX_LOG
    // names the crate.
    let names_crate = std::env::var("OUTBOX_LOG").is_ok_and(|v| v.contains("pgwire_replication"));
    if !names_crate {
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
