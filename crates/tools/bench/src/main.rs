//! `quiltfs-bench`: the benchmark suites, as a binary of their own so that the `quiltfs`
//! binary does not link them (it runs this one for `quiltfs bench ...`). The suites run
//! `quiltfs` for mkfs, mount and stats: the binary in `QUILTFS_BIN`, or the `quiltfs`
//! next to this one, or the one on the PATH.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "quiltfs bench",
    bin_name = "quiltfs bench",
    display_name = "quiltfs-bench",
    version,
    about = "Run a benchmark suite"
)]
struct Cli {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// The IMAP mailbox move of the Featherstitch paper, with Dovecot: kernel ext3,
    /// quiltfs with fsync and with patchgroups, and fsync disabled, side by side.
    Mail(quilt_bench::mail::MailArgs),
    /// The Featherstitch paper's evaluation: untar, delete, PostMark and an Andrew-like
    /// build on every quiltfs mode, kernel ext2/ext3/ext4 and fuse2fs, plus the patch
    /// optimization table; Markdown, CSV, JSON and PNG plots.
    Featherstitch(quilt_bench::featherstitch::FeatherstitchArgs),
    /// The BetrFS papers' evaluation: sequential I/O, random 4-byte writes, find, grep,
    /// rm -rf, TokuBench, rename and clone latency, the native API; kernel ext4, xfs,
    /// btrfs, fuse2fs, both quiltfs modules and the FUSE floor, side by side.
    Betrfs(quilt_bench::betrfs::BetrfsArgs),
    /// Range writes and log skipping (Bark): PostgreSQL pgbench TPC-B with the journal
    /// on a modelled 7200 RPM disk, written as a ring, with log skipping, or not at all,
    /// and kernel ext4 with its external journal on the same model; latency CDFs.
    Bark(quilt_bench::bark::BarkArgs),
    /// Replicated block storage (Gnothi): sequential and random I/O at 4 KiB to 1 MiB
    /// for f = 1 and 2 beside G′, Cheap Paxos and one local disk, all on modelled 7200
    /// RPM disks; bytes stored per replica; catch-up recovery timelines.
    Gnothi(quilt_bench::gnothi::GnothiArgs),
    /// Per-subtree consistency and durability (Cudele): the seven mechanisms and the
    /// paper's compositions, creates in private directories from several client
    /// processes, journal bytes per event; local ext4 beside them.
    Cudele(quilt_bench::cudele::CudeleArgs),
    /// One client process of `cudele` (started by it).
    #[command(hide = true)]
    CudeleClient(quilt_bench::cudele::ClientArgs),
    /// Internal (packaging): write quiltfs-bench(1) and a page per suite into DIR.
    #[command(hide = true)]
    Manpages { dir: std::path::PathBuf },
}

/// quiltfs-bench(1), quiltfs-bench-featherstitch(1), ...: the pages of `quiltfs bench`,
/// whose definitions live here (quiltfs(1) and the rest come from `quiltfs manpages`).
fn manpages(dir: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cmd = <Cli as clap::CommandFactory>::command().disable_help_subcommand(true);
    clap_mangen::generate_to(cmd, dir)
        .with_context(|| format!("writing pages into {}", dir.display()))
}

fn main() {
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("QUILTFS_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // The suites that talk to servers over TCP must not die of a peer that went away
    // while a request was being written (replicas are killed on purpose in the Gnothi
    // suite's recovery runs): with SIGPIPE at its default, a write to a closed socket
    // killed the process (exit status 141, no message). The default stays for the
    // others, whose output may be piped into `head`.
    if matches!(
        cli.command,
        BenchCommand::Gnothi(_) | BenchCommand::Cudele(_) | BenchCommand::CudeleClient(_)
    ) {
        // SAFETY: setting a signal's disposition to ignore touches no memory of ours.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    }
    let r = match cli.command {
        BenchCommand::Mail(a) => quilt_bench::mail::run(a),
        BenchCommand::Featherstitch(a) => quilt_bench::featherstitch::run(a),
        BenchCommand::Betrfs(a) => quilt_bench::betrfs::run(a),
        BenchCommand::Bark(a) => quilt_bench::bark::run(a),
        BenchCommand::Gnothi(a) => quilt_bench::gnothi::run(a),
        BenchCommand::Cudele(a) => quilt_bench::cudele::run(a),
        BenchCommand::CudeleClient(a) => quilt_bench::cudele::client_main(a),
        BenchCommand::Manpages { dir } => manpages(&dir),
    };
    if let Err(e) = r {
        eprintln!("quiltfs bench: error: {e:#}");
        std::process::exit(1);
    }
}
