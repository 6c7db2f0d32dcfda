//! Names the exact build in `quiltfs --version`: the package version and the commit it
//! was built from. A source tree without git (an unpacked tarball) gives the commit in
//! QUILTFS_COMMIT, or is reported as "unknown".

use std::path::Path;
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    println!("cargo:rerun-if-env-changed=QUILTFS_COMMIT");
    // A new commit or checkout moves HEAD or the branch it names; both are files under
    // the git directory, which this reruns on.
    if let Some(git_dir) = git(&dir, &["rev-parse", "--absolute-git-dir"]) {
        let git_dir = Path::new(&git_dir);
        println!("cargo:rerun-if-changed={}", git_dir.join("HEAD").display());
        // Only paths that exist: Cargo reruns a build script on every build while a
        // path it watches is missing, and quilt-cli then compiles again each time. A
        // branch only in packed-refs is watched through its directory, where the next
        // commit writes it.
        let branch = git(&dir, &["symbolic-ref", "-q", "HEAD"]).map(|r| {
            let f = git_dir.join(r);
            match f.parent() {
                Some(d) if !f.exists() => d.to_path_buf(),
                _ => f,
            }
        });
        for f in branch.into_iter().chain([git_dir.join("packed-refs")]) {
            if f.exists() {
                println!("cargo:rerun-if-changed={}", f.display());
            }
        }
    }
    let commit = std::env::var("QUILTFS_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&dir, &["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    let date = git(&dir, &["log", "-1", "--format=%cs", "HEAD"])
        .map(|d| format!(", {d}"))
        .unwrap_or_default();
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    println!("cargo:rustc-env=QUILTFS_COMMIT={commit}");
    println!("cargo:rustc-env=QUILTFS_LONG_VERSION={version} (commit {commit}{date})");
}
