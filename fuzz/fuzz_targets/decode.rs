//! libFuzzer driver of `targets::decode_target` (fuzz/targets.rs): arbitrary bytes into the
//! pgoutput decoder after a valid Relation of the outbox table.
#![no_main]

#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    targets::decode_target(data);
});
