//! The in-process relay's log lines, kept for assertions as well as shown for failing tests.
//!
//! Every relay of a test binary logs through one global subscriber, and tests run side by side:
//! a test asserts on lines that carry its own slot (each test database has a slot of its own),
//! never on a message alone.

use std::io::Write;
use std::sync::Mutex;
use tracing_subscriber::fmt::writer::MakeWriterExt;

/// Every line logged so far in this test binary.
static LINES: Mutex<Vec<u8>> = Mutex::new(Vec::new());

/// Relay logs to the test output (shown for failing tests) and to [`logged`]'s record. Plain
/// text, no colours, so that `slot=name` reads as written.
pub fn init_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("OUTBOX_LOG")
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_ansi(false)
            .with_writer(tracing_subscriber::fmt::TestWriter::new().and(|| Record))
            .try_init();
    });
}

/// Appends to [`LINES`].
struct Record;

impl Write for Record {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LINES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The lines logged so far that contain `message`, whichever relay logged them: only for a
/// message that carries no slot and that one test of the binary alone can cause.
pub fn logged_by_any(message: &str) -> Vec<String> {
    let lines = LINES.lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&lines)
        .lines()
        .filter(|l| l.contains(message))
        .map(str::to_owned)
        .collect()
}

/// The lines logged so far by the relay of `slot` (its `slot` field, quoted or not) that contain
/// `message`.
pub fn logged(slot: &str, message: &str) -> Vec<String> {
    let field = [format!("slot={slot}"), format!("slot=\"{slot}\"")];
    let lines = LINES.lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&lines)
        .lines()
        .filter(|l| l.contains(message))
        .filter(|l| {
            l.split_whitespace()
                .any(|word| field.iter().any(|f| word == f))
        })
        .map(str::to_owned)
        .collect()
}
