//! Where the log goes and how much of it: `--log FILTER` (or `QUILTFS_LOG`, in
//! tracing's filter syntax: `info`, `warn,quilt_gnothi=debug`) and `--log-target
//! stderr|journal|auto`. Both are passed to the processes this one starts (a mount's
//! server, a cluster's replicas) through the environment.

use clap::{Args, ValueEnum};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Errors by default. openraft logs an error for every message to a replica that is
/// down (each read's leadership check among them: thousands a minute while one replica
/// is away); its failures that matter reach the replica as errors of its calls, which
/// it reports itself. `--log openraft=warn` shows them.
const DEFAULT_FILTER: &str = "error,openraft=off";

#[derive(Args, Default, Clone)]
pub struct LogArgs {
    /// What to log, as a tracing filter: error, warn, info, debug, trace, or per
    /// module (warn,quilt_gnothi=debug). Default: QUILTFS_LOG, else errors only.
    #[arg(id = "log_filter", long = "log", global = true, value_name = "FILTER")]
    pub filter: Option<String>,
    /// Where the log goes: stderr, the systemd journal (with each event's fields), or
    /// auto (the journal when stderr is connected to it, as under a systemd unit).
    /// Default: QUILTFS_LOG_TARGET, else auto.
    #[arg(
        id = "log_target",
        long = "log-target",
        global = true,
        value_enum,
        value_name = "TARGET"
    )]
    pub target: Option<Target>,
}

#[derive(ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Target {
    Auto,
    Stderr,
    Journal,
}

/// Whether stderr is the journal's stream: systemd names it in JOURNAL_STREAM as
/// "DEVICE:INODE" for the service's stdout and stderr.
fn stderr_is_journal() -> bool {
    let Ok(v) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.split_once(':') else {
        return false;
    };
    // SAFETY: fstat fills the struct we pass for an fd we do not close.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(2, &mut st) } != 0 {
        return false;
    }
    dev.parse::<u64>().ok() == Some(st.st_dev) && ino.parse::<u64>().ok() == Some(st.st_ino)
}

pub fn init(a: &LogArgs) {
    // The flags win over the environment, and go on to children through it.
    if let Some(f) = &a.filter {
        std::env::set_var("QUILTFS_LOG", f);
    }
    if let Some(t) = a.target {
        if let Some(v) = t.to_possible_value() {
            std::env::set_var("QUILTFS_LOG_TARGET", v.get_name());
        }
    }
    let filter = std::env::var("QUILTFS_LOG").unwrap_or_else(|_| DEFAULT_FILTER.to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("quiltfs: warning: log filter {filter:?} ignored ({e}); logging errors only");
        tracing_subscriber::EnvFilter::new(DEFAULT_FILTER)
    });
    let target = std::env::var("QUILTFS_LOG_TARGET")
        .ok()
        .and_then(|t| Target::from_str(&t, true).ok())
        .unwrap_or(Target::Auto);
    let journal = match target {
        Target::Stderr => false,
        Target::Journal => true,
        Target::Auto => stderr_is_journal(),
    };
    if journal {
        match tracing_journald::layer() {
            Ok(layer) => {
                tracing_subscriber::registry()
                    .with(filter)
                    .with(layer.with_syslog_identifier("quiltfs".into()))
                    .init();
                return;
            }
            Err(e) if target == Target::Journal => {
                eprintln!("quiltfs: warning: cannot reach the journal ({e}); logging to stderr");
            }
            Err(_) => {}
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
