#![no_main]
//! See `quilt_fuzz::run_records`: betrfs's records straight into their decoders.
libfuzzer_sys::fuzz_target!(|data: &[u8]| quilt_fuzz::run_records(data));
