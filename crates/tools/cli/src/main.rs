//! `quiltfs`: the command-line front end of the quiltfs storage stack.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

mod betrfs;
mod cluster_check;
mod crashtest;
mod demo;
mod fileview;
mod image;
mod kv;
mod logging;
mod manpages;
mod mds;
mod mkfs;
mod mount;
mod mount_options;
mod nbd;
mod progress;
mod replica;
mod stats;

// The server allocates and frees small objects (patches, undo bytes, request buffers) at
// a high rate from several threads; mimalloc is markedly cheaper there than glibc's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "quiltfs",
    version = env!("QUILTFS_LONG_VERSION"),
    about = "A user-space storage stack with explicit, programmable write ordering"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: logging::LogArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Drive the patch engine on an image file with a soft-updates-shaped workload and
    /// print its counters for each optimization setting.
    Demo(demo::DemoArgs),
    /// Create an ext2 (default) or betrfs image.
    Mkfs(mkfs::MkfsArgs),
    /// Check a betrfs image (exit status as e2fsck's; ext2 images go to e2fsck).
    Fsck(betrfs::FsckArgs),
    /// Mount an image through FUSE (unmount with `umount MOUNTPOINT`).
    #[command(
        after_long_help = "Every -o option, with what it does, is in quiltfs-mount-options(7); the image formats in quiltfs-formats(5)."
    )]
    Mount(mount::MountArgs),
    /// Unmount and wait for the server to finish writing back (what `umount` does once
    /// the helpers are installed).
    Umount {
        mountpoint: std::path::PathBuf,
        /// Detach now even if busy.
        #[arg(long, short = 'l')]
        lazy: bool,
        /// Only a mount whose server is gone (its directory answers ENOTCONN), which
        /// is then detached; anything else is left alone, and that is no error. For a
        /// service's restart after its server crashed.
        #[arg(long, conflicts_with = "lazy")]
        if_dead: bool,
    },
    /// Make everything written to a mount durable. On mounts made as root (fuseblk),
    /// sync(1) and syncfs(2) do the same; on plain FUSE mounts (made by other users)
    /// the kernel does not pass them on, and this or fsync is the way.
    Sync { mountpoint: std::path::PathBuf },
    /// Copy a directory tree (or a file) on a betrfs mount without copying its data:
    /// the copy shares storage with the original until either changes, and costs the
    /// same whatever the tree holds. DST must not exist. Files alone also clone with
    /// `cp` (copy_file_range) or `cp --reflink` under libquilt_preload.so.
    Clone {
        src: std::path::PathBuf,
        dst: std::path::PathBuf,
    },
    /// Print the counters of a mounted file system, or a summary of an image.
    Stats(stats::StatsArgs),
    /// Explore crash states of a workload and check them (e2fsck, fsync promises).
    Crashtest(crashtest::CrashtestArgs),
    /// Run a benchmark suite (mail, featherstitch, betrfs, bark, gnothi): runs the
    /// `quiltfs-bench` binary installed next to this one (`quiltfs bench --help`).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// The Bε-tree key-value store on an image file: create, put, get, delete,
    /// delete-range, scan.
    #[command(subcommand)]
    Kv(kv::KvCommand),
    /// One replica server of a replicated volume (Gnothi): format its devices, serve.
    #[command(subcommand)]
    Replica(replica::ReplicaCommand),
    /// A replicated volume's replicas as local processes: up, stop, start, status,
    /// down.
    #[command(subcommand)]
    Cluster(replica::ClusterCommand),
    /// Export an image or a replicated volume over NBD (the network block protocol
    /// qemu, nbdcopy, nbd-client and fio speak) until interrupted.
    Nbd(nbd::NbdArgs),
    /// Mount an image or a replicated volume as a directory holding one file whose bytes
    /// are the volume's (for losetup, and the kernel's own file systems on it), until
    /// unmounted.
    FileView(fileview::FileViewArgs),
    /// The namespace service (Cudele): serve an image's namespace to many clients, and
    /// set per-subtree consistency and durability (mount it with
    /// `quiltfs mount mds://HOST:PORT[/SUBTREE]?secret-file=F MOUNTPOINT`).
    #[command(subcommand)]
    Mds(mds::MdsCommand),
    /// Print a shell's completion script for quiltfs (bash, zsh, fish, elvish,
    /// powershell): e.g. `quiltfs completions bash > /etc/bash_completion.d/quiltfs`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Internal (packaging): write every man page into DIR.
    #[command(hide = true)]
    Manpages { dir: std::path::PathBuf },
}

/// `mi_option_purge_delay` of mimalloc 2.1 and later (the Rust bindings list only the
/// options of older versions); the library's version is checked before it is used.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long freed pages stay with the allocator before they go back to the system, ms.
/// 0 for the ext2 module (its eviction and journal checkpoints free memory in bursts,
/// which should not stay resident); 10 for betrfs's servers, mimalloc's own default (its
/// tree frees and takes node-sized buffers all the time: returning them at once made a
/// quarter of a sequential write's time page faults; keeping them a second made an
/// untar 40% slower); 1000 for replica servers (see `replica::serve`).
pub(crate) fn set_allocator_purge_delay(ms: libc::c_long) {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return; // the user's choice stands
    }
    // SAFETY: both calls take and return plain integers.
    unsafe {
        if libmimalloc_sys::mi_version() >= 20100 {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, ms);
        }
    }
}

fn main() {
    // Output piped into `head` ends quietly, as for other command-line tools.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // No transparent huge pages for this process: the allocator asks for them on its
    // arenas (madvise), and then a few live 4 KiB blocks keep a whole 2 MiB page
    // resident. The server's memory must follow its cache budget; with huge pages a
    // 128 MiB cache peaked at 211 MiB in an untar, without them at 173 MiB. Checked at
    // fault time, so it holds for memory mapped before this call too; the mount's
    // server process inherits it. (A failure only costs memory.)
    // SAFETY: PR_SET_THP_DISABLE takes plain integer arguments and touches no memory
    // of ours.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    // Freed pages go back to the system at once rather than after a delay: the cache
    // evicts and the journal releases memory in bursts, and a delay let those bursts
    // pile up (meta-journal PostMark peaked at 185-189 MiB with the 128 MiB cache, 159-
    // 169 MiB this way, no slower within the noise).
    set_allocator_purge_delay(0);
    let argv: Vec<String> = std::env::args().collect();
    let name = argv
        .first()
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_string())
        .unwrap_or_default();
    if name.starts_with("mount.fuse.quiltfs") || name == "mount.quiltfs" {
        logging::init(&logging::LogArgs::default());
        if let Err(e) = mount::helper_main(argv) {
            eprintln!("quiltfs: error: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    // (util-linux runs umount.fuseblk.quiltfs for root's block-device mounts, and
    // umount.fuse.quiltfs for plain FUSE ones.)
    if name.starts_with("umount.fuse.quiltfs")
        || name.starts_with("umount.fuseblk.quiltfs")
        || name == "umount.quiltfs"
    {
        logging::init(&logging::LogArgs::default());
        if let Err(e) = mount::umount_helper_main(argv) {
            eprintln!("quiltfs: error: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    let cli = Cli::parse();
    logging::init(&cli.log);
    // Processes that talk to replicas over TCP must not die of a peer that went away
    // while a request was being written (the default disposition restored above is
    // for output piped into `head`).
    if matches!(
        cli.command,
        Command::Replica(_)
            | Command::Cluster(_)
            | Command::Nbd(_)
            | Command::FileView(_)
            | Command::Mds(_)
    ) || argv.iter().any(|a| {
        quilt_gnothi::device::VolumeAddress::is_address(a)
            || quilt_cudele::MdsAddress::is_address(a)
    }) {
        // SAFETY: setting a signal's disposition to ignore touches no memory of ours.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    }
    if let Err(e) = run(cli) {
        eprintln!("quiltfs: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Demo(args) => demo::run(args).context("demo failed"),
        Command::Mkfs(a) => mkfs::run(a),
        Command::Fsck(a) => {
            let code = betrfs::fsck(a)?;
            std::process::exit(code)
        }
        Command::Mount(a) => mount::run(a),
        Command::Stats(a) => stats::run(a),
        Command::Sync { mountpoint } => mount::sync_mount(&mountpoint),
        Command::Clone { src, dst } => {
            let t = std::time::Instant::now();
            quilt_pg::clone::clone_tree(&src, &dst).map_err(|e| {
                let hint = match e.raw_os_error() {
                    Some(libc::ENOTTY) | Some(libc::EOPNOTSUPP) => {
                        " (clones need a betrfs mount: quiltfs mkfs --fs betrfs)"
                    }
                    Some(libc::EXDEV) => " (both must be on the same mount)",
                    _ => "",
                };
                anyhow::anyhow!("cloning {} to {}: {e}{hint}", src.display(), dst.display())
            })?;
            eprintln!(
                "quiltfs: cloned {} to {} in {:.1?}",
                src.display(),
                dst.display(),
                t.elapsed()
            );
            Ok(())
        }
        Command::Umount {
            mountpoint,
            if_dead: true,
            ..
        } => mount::detach_if_dead(&mountpoint),
        Command::Umount {
            mountpoint, lazy, ..
        } => mount::unmount_and_wait(&mountpoint, lazy),
        Command::Crashtest(a) => crashtest::run(a),
        Command::Kv(c) => kv::run(c),
        Command::Bench { args } => bench(args),
        Command::Replica(c) => replica::run_replica(c),
        Command::Cluster(c) => replica::run_cluster(c),
        Command::Nbd(a) => nbd::run(a),
        Command::FileView(a) => fileview::run(a),
        Command::Mds(c) => mds::run(c),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "quiltfs", &mut std::io::stdout());
            Ok(())
        }
        Command::Manpages { dir } => manpages::write_all(&dir),
    }
}

/// `quiltfs bench ...`: the suites live in `quiltfs-bench` (so that this binary does not
/// link them); it is run with the same arguments and told which `quiltfs` to drive.
fn bench(args: Vec<std::ffi::OsString>) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let me = std::env::current_exe().context("finding the quiltfs binary")?;
    let sibling = me.with_file_name("quiltfs-bench");
    let exe = if sibling.is_file() {
        sibling
    } else {
        "quiltfs-bench".into()
    };
    let err = std::process::Command::new(&exe)
        .args(args)
        .env("QUILTFS_BIN", &me)
        .exec();
    Err(anyhow::anyhow!(
        "cannot run {} ({err}): the benchmarks are a binary of their own, built with the workspace (cargo build --release) and installed by scripts/setup.sh",
        exe.display()
    ))
}

#[cfg(test)]
mod tests {
    /// clap's own checks of the definitions (two arguments with one id, a global flag
    /// shadowing a subcommand's argument, ...), which it otherwise makes only when a
    /// command line reaches the faulty part.
    #[test]
    fn the_command_line_definitions_are_consistent() {
        <super::Cli as clap::CommandFactory>::command().debug_assert();
    }
}
