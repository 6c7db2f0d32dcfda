#![no_main]
//! See `quilt_fuzz::TreeRegion::Log`. The seed image is built before the first input.
libfuzzer_sys::fuzz_target!(
    init: quilt_fuzz::prepare_tree(),
    |data: &[u8]| quilt_fuzz::run_tree(quilt_fuzz::TreeRegion::Log, data)
);
