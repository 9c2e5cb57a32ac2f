//! The deterministic simulation of the delivery core, in CI: many seeds, each a random schedule
//! of load and faults checked at every step (see tests/sim/mod.rs). `OUTBOX_SIM_SEEDS` sets how
//! many (default 30; CI runs thousands more in release, see .ci/run), `OUTBOX_SIM_FROM` the first; a failure prints its seed and the command
//! that replays it. The long mode is `scripts/simulate.sh`.

mod sim;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn no_event_is_lost_under_any_simulated_schedule() {
    let from = env_u64("OUTBOX_SIM_FROM", 1);
    let seeds = env_u64("OUTBOX_SIM_SEEDS", 30);
    let opts = sim::Options::default();
    let (mut rows, mut tasks, mut faults, mut sim_secs, mut peak) = (0, 0, 0, 0, 0);
    for seed in from..from + seeds {
        match sim::run(seed, &opts) {
            Ok(o) => {
                rows += o.rows;
                tasks += o.tasks;
                faults += o.faults;
                sim_secs += o.sim_secs;
                peak = peak.max(o.peak_write_bytes);
            }
            Err(f) => panic!("{f}"),
        }
    }
    eprintln!(
        "{seeds} schedules, {rows} rows, {tasks} tasks, {faults} faults, {sim_secs} simulated \
         seconds, peak bytes held by writes {peak}: no violation"
    );
}
