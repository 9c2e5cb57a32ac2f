//! The `outbox-relay` binary: parse the CLI, set up logging, run the library, map errors to
//! exit codes (0 success or clean shutdown, 1 runtime failure, 2 bad configuration).

use anyhow::Context;
use clap::Parser;
use outbox_relay::config::{Cli, Command, DeadLettersCommand, LogFormat};
use outbox_relay::metrics::Metrics;
use outbox_relay::replication::stream::error_chain;
use std::process::ExitCode;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            eprintln!("{}", name_the_env_var(&e));
            return ExitCode::from(2);
        }
    };
    if let Err(e) = validate(&cli.command) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    init_tracing(cli.log_format);
    let mut builder = if cli.worker_threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(cli.worker_threads);
        b
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %error_chain(e.as_ref()), "outbox-relay failed");
            eprintln!("error: {}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Settings that parse but cannot be used, refused before anything connects.
fn validate(command: &Command) -> Result<(), outbox_relay::config::ConfigError> {
    match command {
        Command::Run(args) => args.validate(),
        Command::Migrate(args) => args.db.target().map(|_| ()),
        Command::Peek(args) => args.valkey.target().map(|_| ()),
        Command::DeadLetters(DeadLettersCommand::List { db, .. })
        | Command::DeadLetters(DeadLettersCommand::Retry { db, .. }) => db.target().map(|_| ()),
        Command::Cleanup(args) => args.db.target().map(|_| ()),
        Command::Status(args) => {
            args.db.target()?;
            args.valkey.target().map(|_| ())
        }
        Command::Trace(args) => targets(&args.db, &args.valkey),
        Command::Replay(args) => targets(&args.db, &args.valkey),
        Command::Reconcile(args) => args.validate(),
    }
}

fn targets(
    db: &outbox_relay::config::DatabaseArgs,
    valkey: &outbox_relay::config::ValkeyArgs,
) -> Result<(), outbox_relay::config::ConfigError> {
    db.target()?;
    valkey.target().map(|_| ())
}

/// clap's error, with the environment variable of the offending flag named too.
fn name_the_env_var(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
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
    let env_of = |arg: &str| {
        let long = arg
            .split_whitespace()
            .next()
            .unwrap_or("")
            .trim_start_matches("--");
        std::iter::once(&cmd)
            .chain(cmd.get_subcommands())
            .flat_map(|c| c.get_arguments())
            .find(|a| a.get_long() == Some(long))
            .and_then(|a| a.get_env())
            .map(|v| v.to_string_lossy().into_owned())
    };
    let envs: Vec<String> = args.iter().filter_map(|a| env_of(a)).collect();
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

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(args) => {
            let mut registry = prometheus_client::registry::Registry::default();
            let metrics = Arc::new(Metrics::new(&mut registry));
            let shutdown = CancellationToken::new();
            tokio::spawn(wait_for_signal(shutdown.clone()));
            let listener = tokio::net::TcpListener::bind(args.metrics_addr)
                .await
                .with_context(|| {
                    format!("cannot listen on OUTBOX_METRICS_ADDR {}", args.metrics_addr)
                })?;
            let http_stop = CancellationToken::new();
            let http = tokio::spawn(outbox_relay::http::serve(
                listener,
                Arc::new(registry),
                metrics.clone(),
                http_stop.clone(),
            ));
            let result = outbox_relay::relay::run(&args, metrics, shutdown).await;
            http_stop.cancel();
            let _ = http.await;
            result?;
            Ok(())
        }
        Command::Status(args) => {
            let client = args.db.target()?.connect().await?;
            let valkey = match args.valkey.target()?.connect().await {
                Ok(conn) => Some(conn),
                Err(e) => {
                    tracing::warn!(error = %e, valkey = %args.valkey.display(), "valkey unreachable");
                    None
                }
            };
            let status = outbox_relay::status::collect(
                &client,
                valkey,
                &args.db.table,
                &args.db.publication,
                &args.slot,
            )
            .await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{}", outbox_relay::status::render(&status));
            }
            Ok(())
        }
        Command::Peek(args) => {
            let mut conn = args
                .valkey
                .target()?
                .connect()
                .await
                .with_context(|| format!("cannot reach Valkey at {}", args.valkey.display()))?;
            let tasks = outbox_relay::inspect::peek(&mut conn, &args.queue, args.limit).await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&tasks)?);
            } else {
                print!("{}", outbox_relay::inspect::render(&tasks));
            }
            Ok(())
        }
        Command::DeadLetters(cmd) => dead_letters(cmd).await,
        Command::Trace(args) => print(
            args.json,
            &outbox_relay::trace::trace(&args).await?[..],
            outbox_relay::trace::render,
        ),
        Command::Replay(args) => print(
            args.json,
            &outbox_relay::replay::replay(&args).await?,
            outbox_relay::replay::render,
        ),
        Command::Reconcile(args) => print(
            args.json,
            &outbox_relay::reconcile::reconcile(&args).await?,
            outbox_relay::reconcile::render,
        ),
        Command::Cleanup(args) => {
            let client = args.db.target()?.connect().await?;
            let store = outbox_relay::store::Store::new(args.db.table.clone());
            let n =
                outbox_relay::admin::cleanup(&client, &store, args.older_than, args.batch).await?;
            println!("deleted {n} published row(s)");
            Ok(())
        }
        Command::Migrate(args) => {
            let pg = args.db.target()?;
            let mut client = pg.connect().await?;
            outbox_relay::migrate::migrate(
                &mut client,
                &args.db.table,
                &args.db.publication,
                args.with_notify_trigger,
            )
            .await
            .context("outbox-relay migrate")?;
            tracing::info!(table = %args.db.table, publication = %args.db.publication, "migrations applied");
            Ok(())
        }
    }
}

/// An operator command's result as JSON or as its text rendering.
fn print<T: serde::Serialize + ?Sized>(
    json: bool,
    value: &T,
    render: fn(&T) -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(value)?);
    } else {
        print!("{}", render(value));
    }
    Ok(())
}

async fn dead_letters(cmd: DeadLettersCommand) -> anyhow::Result<()> {
    match cmd {
        DeadLettersCommand::List { db, json } => {
            let client = db.target()?.connect().await?;
            let rows = outbox_relay::store::Store::new(db.table.clone())
                .dead_letters(&client)
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", outbox_relay::admin::render_dead_letters(&rows));
            }
        }
        DeadLettersCommand::Retry { db, all, event_id } => {
            let client = db.target()?.connect().await?;
            let store = outbox_relay::store::Store::new(db.table.clone());
            let ids = (!all).then_some(event_id.as_slice());
            let n = store.retry_dead_letters(&client, ids).await?;
            println!("{n} dead letter(s) will be delivered again");
        }
    }
    Ok(())
}

/// Cancels `token` on SIGINT or SIGTERM.
async fn wait_for_signal(token: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
    token.cancel();
}
