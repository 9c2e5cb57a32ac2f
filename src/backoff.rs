//! Capped exponential backoff with jitter: the one retry-delay helper. Callers decide what is
//! retryable.
//!
//! The jitter comes from the thread's random generator, or, under the deterministic simulation,
//! from a generator seeded by the simulation's seed ([`seed_jitter`]), so that a seed replays the
//! same delays.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;
use std::time::Duration;

thread_local! {
    static SEEDED: RefCell<Option<SmallRng>> = const { RefCell::new(None) };
}

/// Makes this thread's jitter deterministic (`Some(seed)`), or random again (`None`).
pub fn seed_jitter(seed: Option<u64>) {
    SEEDED.with(|s| *s.borrow_mut() = seed.map(SmallRng::seed_from_u64));
}

fn jitter() -> f64 {
    SEEDED.with(|s| match s.borrow_mut().as_mut() {
        Some(rng) => rng.random_range(0.0..0.25),
        None => rand::rng().random_range(0.0..0.25),
    })
}

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            current: initial,
        }
    }

    /// The next delay: the current step with up to 25% jitter taken off, then the step doubles
    /// up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.current;
        self.current = (self.current * 2).min(self.max);
        step.mul_f64(1.0 - jitter())
    }

    /// Back to the first step after a success.
    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let delays: Vec<_> = (0..6).map(|_| b.next_delay()).collect();
        assert!(delays[0] <= Duration::from_millis(100) && delays[0] > Duration::from_millis(74));
        assert!(delays[1] <= Duration::from_millis(200) && delays[1] > Duration::from_millis(149));
        assert!(delays[5] <= Duration::from_secs(1) && delays[5] > Duration::from_millis(749));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
