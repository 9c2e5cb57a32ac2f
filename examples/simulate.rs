//! Runs the delivery core's deterministic simulation (tests/sim) for many seeds, or replays one.
//!
//! ```text
//! cargo run --release --example simulate -- --seeds 100000 [--from 1]
//! cargo run --example simulate -- --seed 4242 --verbose
//! cargo run --release --example simulate -- --seeds 300 --fail-fast   # stop at the first failure
//! ```

#[path = "../tests/sim/mod.rs"]
mod sim;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut from = 1u64;
    let mut seeds = 1000u64;
    let mut opts = sim::Options::default();
    let mut fail_fast = false;
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{what} takes a number"))
        };
        match a.as_str() {
            "--seed" => {
                from = num("--seed");
                seeds = 1;
            }
            "--from" => from = num("--from"),
            "--seeds" => seeds = num("--seeds"),
            "--steps" => opts.steps = num("--steps") as usize,
            "--verbose" => opts.verbose = true,
            "--fail-fast" => fail_fast = true,
            other => {
                eprintln!("unknown argument {other:?}; see the header of examples/simulate.rs");
                std::process::exit(2);
            }
        }
    }
    let started = std::time::Instant::now();
    let (mut rows, mut tasks, mut faults, mut failed) = (0usize, 0usize, 0usize, 0u64);
    let (mut sim_secs, mut peak) = (0u64, 0usize);
    let mut ran = 0u64;
    for seed in from..from + seeds {
        ran += 1;
        match sim::run(seed, &opts) {
            Ok(o) => {
                rows += o.rows;
                tasks += o.tasks;
                faults += o.faults;
                sim_secs += o.sim_secs;
                peak = peak.max(o.peak_write_bytes);
                if opts.verbose {
                    eprintln!("{o:?}");
                }
            }
            Err(f) => {
                failed += 1;
                eprintln!("{f}");
                if fail_fast {
                    break;
                }
            }
        }
        if (seed - from + 1).is_multiple_of(1000) {
            eprintln!(
                "{} schedules, {rows} rows, {faults} faults, {failed} failed, {:.0?}",
                seed - from + 1,
                started.elapsed()
            );
        }
    }
    println!(
        "{ran} schedules from seed {from}: {rows} rows, {tasks} tasks, {faults} faults, \
         {sim_secs} simulated seconds, peak bytes held by writes {peak}; {failed} failed, in {:.1?}",
        started.elapsed()
    );
    std::process::exit(i32::from(failed > 0));
}
