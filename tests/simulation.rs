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

/// Every mutant of `tests/sim/mutants/` still applies to the tree, so `scripts/sim-mutants.sh`
/// (late in CI, in release) does not stop on a stale patch: found when a change to the writer
/// left three of them behind. Needs the `patch` tool (`.ci/run` installs it).
#[test]
fn every_simulation_mutant_applies_to_the_tree() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut stale = Vec::new();
    let mut seen = 0;
    for entry in std::fs::read_dir(root.join("tests/sim/mutants")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "patch") {
            continue;
        }
        seen += 1;
        let out = std::process::Command::new("patch")
            // --forward: a patch that looks reversed fails instead of asking on the terminal.
            .args(["-p1", "--dry-run", "--forward", "--quiet", "-i"])
            .arg(&path)
            .current_dir(root)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("the patch tool runs");
        if !out.status.success() {
            stale.push(format!(
                "{}: {}{}",
                path.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    assert!(seen > 0, "no mutants found");
    assert!(stale.is_empty(), "stale mutants:\n{}", stale.join("\n"));
}
