//! The four workloads of the Featherstitch evaluation and their inputs, prepared once
//! outside any timing: the linux-source tarball decompressed, the lz4 C sources unpacked,
//! the PostMark configuration.

use crate::{sh, Reaped, LINUX_TOP};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    Untar,
    Delete,
    Postmark,
    Andrew,
}

pub const ALL: [Workload; 4] = [
    Workload::Untar,
    Workload::Delete,
    Workload::Postmark,
    Workload::Andrew,
];

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Untar => "untar",
            Workload::Delete => "delete",
            Workload::Postmark => "postmark",
            Workload::Andrew => "andrew",
        }
    }

    pub fn parse(s: &str) -> Result<Workload> {
        ALL.into_iter()
            .find(|w| w.name() == s.trim())
            .with_context(|| {
                format!("unknown workload '{s}' (one of: untar, delete, postmark, andrew)")
            })
    }
}

const LZ4_CRATE: &str = "lz4-sys";
const LZ4_VERSION: &str = "1.11.1";

/// Everything the workloads read, ready on the local disk.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Inputs {
    pub tarball: PathBuf,
    pub tarball_bytes: u64,
    pub tarball_entries: u64,
    /// The C source tree the Andrew-like build copies (lz4's).
    pub source: PathBuf,
    pub source_files: u64,
    pub source_bytes: u64,
    /// What `make` builds in it.
    pub make_targets: Vec<String>,
    pub postmark: PostmarkConfig,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PostmarkConfig {
    pub files: u32,
    pub transactions: u32,
    pub min_size: u32,
    pub max_size: u32,
    pub seed: u32,
}

pub fn prepare(work: &Path, quick: bool) -> Result<Inputs> {
    let tarball = crate::linux_tarball(work, quick)?;
    let tarball_entries = sh(Command::new("tar").arg("tf").arg(&tarball))?
        .lines()
        .count() as u64;
    let tarball_bytes = std::fs::metadata(&tarball)?.len();
    let source = lz4_tree(work)?;
    let (source_files, source_bytes) = tree_size(&source)?;
    let make_targets = if quick {
        // Two of the library's objects: a few seconds of compiling.
        vec!["-C".into(), "lib".into(), "lz4.o".into(), "xxhash.o".into()]
    } else {
        // The library and the lz4 program (the Makefile's default).
        vec![]
    };
    let postmark = if quick {
        PostmarkConfig {
            files: 200,
            transactions: 200,
            min_size: 500,
            max_size: 1 << 20,
            seed: 42,
        }
    } else {
        PostmarkConfig {
            files: 500,
            transactions: 500,
            min_size: 500,
            max_size: 4 << 20,
            seed: 42,
        }
    };
    Ok(Inputs {
        tarball,
        tarball_bytes,
        tarball_entries,
        source,
        source_files,
        source_bytes,
        make_targets,
        postmark,
    })
}

/// lz4's sources as the lz4-sys crate bundles them, fetched by cargo and unpacked into
/// the work directory (the crate is never built).
fn lz4_tree(work: &Path) -> Result<PathBuf> {
    let dir = work.join(format!("{LZ4_CRATE}-{LZ4_VERSION}"));
    let tree = dir.join("liblz4");
    if tree.join("Makefile").exists() {
        return Ok(tree);
    }
    let probe = work.join("lz4-fetch");
    std::fs::create_dir_all(probe.join("src"))?;
    std::fs::write(
        probe.join("Cargo.toml"),
        format!(
            "[package]\nname = \"lz4-fetch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n\
             [dependencies]\n{LZ4_CRATE} = \"={LZ4_VERSION}\"\n\n[workspace]\n"
        ),
    )?;
    std::fs::write(probe.join("src/lib.rs"), "")?;
    eprintln!("bench: fetching the lz4 sources ({LZ4_CRATE} {LZ4_VERSION}) with cargo");
    sh(Command::new("cargo")
        .arg("fetch")
        .arg("--manifest-path")
        .arg(probe.join("Cargo.toml"))
        .env_remove("CARGO_TARGET_DIR"))
    .context("cargo fetch of the lz4 sources (is cargo installed and crates.io reachable?)")?;
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    let cache = home.join("registry/cache");
    let want = format!("{LZ4_CRATE}-{LZ4_VERSION}+");
    let crate_file = std::fs::read_dir(&cache)
        .with_context(|| format!("reading {}", cache.display()))?
        .flatten()
        .flat_map(|index| {
            std::fs::read_dir(index.path())
                .into_iter()
                .flatten()
                .flatten()
        })
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&want) && n.ends_with(".crate"))
        })
        .with_context(|| format!("cargo fetched no {want}*.crate into {}", cache.display()))?;
    let tmp = work.join("lz4-unpack");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    sh(Command::new("tar")
        .arg("xzf")
        .arg(&crate_file)
        .arg("-C")
        .arg(&tmp))?;
    let unpacked = std::fs::read_dir(&tmp)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("liblz4/Makefile").exists())
        .context("the lz4-sys crate has no liblz4/Makefile")?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&unpacked, &dir)?;
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_dir_all(&probe);
    Ok(tree)
}

fn tree_size(dir: &Path) -> Result<(u64, u64)> {
    let mut files = 0;
    let mut bytes = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                stack.push(e.path());
            } else {
                files += 1;
                bytes += e.metadata()?.len();
            }
        }
    }
    Ok((files, bytes))
}

impl Inputs {
    /// Untimed preparation on a fresh mount before the workload starts. Reads the inputs
    /// once so that they come from the page cache (the paper's "cached file"), after the
    /// caches were dropped for the file system under test.
    pub fn before(&self, w: Workload, mnt: &Path, work: &Path) -> Result<()> {
        match w {
            Workload::Untar => {
                sh(Command::new("cat").arg(&self.tarball).stdout(Stdio::null()))?;
            }
            Workload::Delete => {
                if !mnt.join(LINUX_TOP).is_dir() {
                    bail!("delete needs the untar result, and {LINUX_TOP} is not there");
                }
            }
            Workload::Postmark => {
                std::fs::create_dir_all(mnt.join("postmark"))?;
                let p = &self.postmark;
                std::fs::write(
                    work.join("postmark.cfg"),
                    format!(
                        "set location {}\nset size {} {}\nset number {}\nset transactions {}\n\
                         set seed {}\nset report terse\nrun\nquit\n",
                        mnt.join("postmark").display(),
                        p.min_size,
                        p.max_size,
                        p.files,
                        p.transactions,
                        p.seed
                    ),
                )?;
            }
            Workload::Andrew => {
                sh(Command::new("tar")
                    .arg("cf")
                    .arg("-")
                    .arg("-C")
                    .arg(&self.source)
                    .arg(".")
                    .stdout(Stdio::null()))?;
            }
        }
        Ok(())
    }

    /// The timed command: one shell script, so that its CPU (and its children's) is
    /// counted by one wait.
    pub fn command(&self, w: Workload, mnt: &Path, work: &Path) -> Command {
        let q = |p: &Path| shell_quote(&p.display().to_string());
        let script = match w {
            Workload::Untar => format!("tar xf {} -C {}", q(&self.tarball), q(mnt)),
            Workload::Delete => format!("rm -rf {}", q(&mnt.join(LINUX_TOP))),
            Workload::Postmark => format!("postmark {} >/dev/null", q(&work.join("postmark.cfg"))),
            Workload::Andrew => {
                let src = q(&self.source);
                let dst = q(&mnt.join("andrew"));
                let targets: Vec<String> =
                    self.make_targets.iter().map(|t| shell_quote(t)).collect();
                // The modified Andrew benchmark's phases: make the directory hierarchy,
                // copy the tree, stat every file, read every file, compile.
                format!(
                    "set -e\n\
                     mkdir {dst}\n\
                     (cd {src} && find . -type d -print0) | (cd {dst} && xargs -0 mkdir -p)\n\
                     cp -a {src}/. {dst}/\n\
                     find {dst} -ls >/dev/null\n\
                     find {dst} -type f -exec cat {{}} + >/dev/null\n\
                     make -s -j1 -C {dst} {} >/dev/null\n",
                    targets.join(" ")
                )
            }
        };
        let mut c = Command::new("sh");
        c.arg("-c").arg(script);
        // A make jobserver of whoever started us must not reach the build.
        c.env_remove("MAKEFLAGS")
            .env_remove("MFLAGS")
            .env_remove("MAKELEVEL");
        c
    }
}

/// Runs the timed command; its wall seconds and CPU.
pub fn run_timed(mut c: Command, errlog: &Path) -> Result<(f64, Reaped)> {
    let err = std::fs::File::create(errlog)?;
    let t0 = std::time::Instant::now();
    let child = c
        .stdin(Stdio::null())
        .stderr(err)
        .spawn()
        .context("starting the workload")?;
    let r = crate::reap(&child)?;
    let secs = t0.elapsed().as_secs_f64();
    if !r.success() {
        bail!(
            "the workload failed (status {}): {}",
            r.status,
            super::systems::log_tail(errlog)
        );
    }
    Ok((secs, r))
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}
