#![no_main]
//! See `quilt_fuzz::Region::Xattrs`. The seed images are built before the first input, so
//! their cost is not charged to it.
libfuzzer_sys::fuzz_target!(
    init: quilt_fuzz::prepare(),
    |data: &[u8]| quilt_fuzz::run(quilt_fuzz::Region::Xattrs, data)
);
