//! The C header repeats the ioctl numbers and structures of `quilt_pg::abi`: a C program
//! built against it prints them, and they must agree.

use quilt_pg::abi;

#[test]
fn the_c_header_agrees_with_the_abi() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("probe.c");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include "quiltfs_pg.h"
int main(void) {
    printf("%lu %lu %lu %lu %lu %lu %lu %lu %lu %lu %lu %zu %zu\n",
        (unsigned long)QFS_PG_IOC_CREATE, (unsigned long)QFS_PG_IOC_DEPEND,
        (unsigned long)QFS_PG_IOC_RELEASE, (unsigned long)QFS_PG_IOC_ENGAGE,
        (unsigned long)QFS_PG_IOC_DISENGAGE, (unsigned long)QFS_PG_IOC_SYNC,
        (unsigned long)QFS_PG_IOC_ABANDON, (unsigned long)QFS_PG_IOC_LAST_ERROR,
        (unsigned long)QFS_PG_IOC_NEXT,
        (unsigned long)QFS_IOC_CLONE_RANGE, (unsigned long)QFS_IOC_CLONE_TREE,
        sizeof(struct qfs_clone_range_args), sizeof(struct qfs_clone_tree_args));
    return 0;
}
"#,
    )
    .unwrap();
    let exe = dir.path().join("probe");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    let cc = std::process::Command::new("cc")
        .args(["-I", include, "-o"])
        .arg(&exe)
        .arg(&src)
        .status();
    let Ok(status) = cc else {
        if std::env::var_os("QUILT_REQUIRE_FUSE").is_some() {
            panic!("no C compiler to check the header with");
        }
        eprintln!("skipped: no C compiler");
        return;
    };
    assert!(status.success(), "the header does not compile");
    let out = std::process::Command::new(&exe).output().unwrap();
    let got: Vec<u64> = String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let want: Vec<u64> = [
        abi::CREATE,
        abi::DEPEND,
        abi::RELEASE,
        abi::ENGAGE,
        abi::DISENGAGE,
        abi::SYNC,
        abi::ABANDON,
        abi::LAST_ERROR,
        abi::NEXT,
        abi::CLONE_RANGE,
        abi::CLONE_TREE,
    ]
    .iter()
    .map(|&c| c as u64)
    .chain([
        std::mem::size_of::<abi::CloneRangeArgs>() as u64,
        std::mem::size_of::<abi::CloneTreeArgs>() as u64,
    ])
    .collect();
    assert_eq!(got, want);
}
