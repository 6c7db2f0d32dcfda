//! `quiltfs`: the command-line front end of the quiltfs storage stack.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

mod demo;

#[derive(Parser)]
#[command(
    name = "quiltfs",
    version,
    about = "A user-space storage stack with explicit, programmable write ordering"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Drive the patch engine on an image file with a soft-updates-shaped workload and
    /// print its counters for each optimization setting.
    Demo(demo::DemoArgs),
    /// Create an ext2/ext3 image (not implemented yet: issue #3).
    Mkfs { image: PathBuf },
    /// Mount an image through FUSE (not implemented yet: issue #3).
    Mount { image: PathBuf, mountpoint: PathBuf },
    /// Print the counters of a mounted file system (not implemented yet: issue #3).
    Stats { target: PathBuf },
    /// Explore crash states of a workload (not implemented yet: issue #5).
    Crashtest,
    /// Run the benchmark suites (not implemented yet: issues #6 and #7).
    Bench,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("QUILTFS_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("quiltfs: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Demo(args) => demo::run(args).context("demo failed"),
        Command::Mkfs { .. } | Command::Mount { .. } | Command::Stats { .. } => {
            bail!("this command is not implemented yet; it arrives with the ext2 module (issue #3)")
        }
        Command::Crashtest => bail!("this command is not implemented yet (issue #5)"),
        Command::Bench => bail!("this command is not implemented yet (issues #6 and #7)"),
    }
}
