//! libFuzzer driver of `targets::task_target` (fuzz/targets.rs): arbitrary column text into the
//! task builder.
#![no_main]

#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    targets::task_target(data);
});
