//! libfuse's `passthrough_hp`, the FUSE floor the suites compare with: a low-level,
//! multi-threaded passthrough that splices data and, unless told not to, hands reads and
//! writes to the kernel (FUSE passthrough, Linux 6.9 and later). It is what FUSE costs
//! when the server does no work of its own, so "at or below the floor" means something.
//!
//! Debian ships libfuse's examples without it (it is C++ and needs the library's own
//! build), so the suites build it from the libfuse source Debian distributes: a pinned
//! version, checked against its SHA-256 from the Debian source package before anything
//! is unpacked, built with meson against a static libfuse, and cached for later runs.
//! Nothing of libfuse is in this repository.

use crate::sh;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The libfuse release (Debian's fuse3 in trixie): new enough for FUSE passthrough,
/// which `passthrough_hp` uses by default since 3.16.
pub const LIBFUSE_VERSION: &str = "3.17.2";
const TARBALL: &str = "fuse3_3.17.2.orig.tar.gz";
const URL: &str = "http://deb.debian.org/debian/pool/main/f/fuse3/fuse3_3.17.2.orig.tar.gz";
/// From the Debian source package's .dsc (fuse3_3.17.2-3.dsc, Checksums-Sha256).
const SHA256: &str = "3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f";

/// Where built binaries are kept between runs and suites.
fn cache_dir() -> PathBuf {
    PathBuf::from(format!("/var/cache/quiltfs/libfuse-{LIBFUSE_VERSION}"))
}

/// The path of a built `passthrough_hp`, building it first if no run has yet.
pub fn passthrough_hp() -> Result<PathBuf> {
    let bin = cache_dir().join("passthrough_hp");
    if bin.is_file() {
        return Ok(bin);
    }
    build(&bin).with_context(|| {
        format!(
            "building libfuse {LIBFUSE_VERSION}'s passthrough_hp (the FUSE floor) from {URL}; \
             leave the passthrough systems out with --systems to run without it"
        )
    })?;
    Ok(bin)
}

fn build(bin: &Path) -> Result<()> {
    crate::apt_install(&["curl", "meson", "ninja-build", "g++", "pkg-config"])?;
    let dir = cache_dir();
    let tmp = dir.join("build-tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    eprintln!(
        "bench: building libfuse {LIBFUSE_VERSION}'s passthrough_hp (once; cached in {})",
        dir.display()
    );
    let tarball = tmp.join(TARBALL);
    sh(Command::new("curl")
        .args(["-fsSL", "--retry", "3", "-m", "300", "-o"])
        .arg(&tarball)
        .arg(URL))?;
    let sum = sh(Command::new("sha256sum").arg(&tarball))?;
    let got = sum.split_whitespace().next().unwrap_or("");
    if got != SHA256 {
        bail!(
            "{TARBALL} has SHA-256 {got}, Debian's source package says {SHA256}: not building it"
        );
    }
    sh(Command::new("tar")
        .arg("-xzf")
        .arg(&tarball)
        .arg("-C")
        .arg(&tmp))?;
    let src = tmp.join(format!("fuse-{LIBFUSE_VERSION}"));
    let out = tmp.join("build");
    sh(Command::new("meson")
        .arg("setup")
        .arg(&out)
        .arg(&src)
        .args([
            "-Ddefault_library=static",
            "-Dbuildtype=release",
            "-Dutils=false",
            "-Dtests=false",
            "-Dexamples=true",
            "-Ddisable-mtab=true",
            "-Dinitscriptdir=",
        ])
        .arg(format!("-Dudevrulesdir={}", tmp.join("udev").display())))?;
    sh(Command::new("ninja")
        .arg("-C")
        .arg(&out)
        .arg("example/passthrough_hp"))?;
    // Into place in one rename, so an interrupted build is never taken for a built one.
    let staged = dir.join("passthrough_hp.new");
    std::fs::copy(out.join("example/passthrough_hp"), &staged)?;
    std::fs::rename(&staged, bin)?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}
