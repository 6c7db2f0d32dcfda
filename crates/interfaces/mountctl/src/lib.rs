//! The control socket of a running quiltfs mount: one Unix socket per mount point under
//! `/run/quiltfs`, named by a hash of the mount point's canonical path, through which
//! `quiltfs sync`, `quiltfs stats`, `quiltfs umount` and the benchmark suites talk to the
//! mount's server. A request is one line (`sync`, `stats`, `image`); the answer is the
//! rest of the stream. The server side (`quiltfs mount`) binds [`runtime_paths`]'s
//! socket and answers; this crate is the protocol's one description.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Where the control socket and the server's log of a mount live.
pub fn runtime_paths(mountpoint: &Path) -> (PathBuf, PathBuf) {
    let canon = mountpoint
        .canonicalize()
        .unwrap_or_else(|_| mountpoint.to_path_buf());
    let s = canon.display().to_string();
    // FNV-1a: stable across builds (the socket must be found by any later binary).
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    let dir = PathBuf::from("/run/quiltfs");
    (
        dir.join(format!("{h:016x}.sock")),
        dir.join(format!("{h:016x}.log")),
    )
}

/// Where the server of `mountpoint` with process id `pid` leaves how its unmount ended
/// (`ok`, or `error: ...`), for `quiltfs umount` to read once the process is gone:
/// the kernel ignores a FUSE server's answer to DESTROY, so this is the only way the
/// outcome of the final write-back reaches the one who unmounted.
pub fn status_path(mountpoint: &Path, pid: u32) -> PathBuf {
    let (sock, _) = runtime_paths(mountpoint);
    sock.with_extension(format!("{pid}.status"))
}

/// One request to the server of `mountpoint`; its answer.
pub fn ask(mountpoint: &Path, what: &str) -> std::io::Result<String> {
    let (sock, _) = runtime_paths(mountpoint);
    let mut s = UnixStream::connect(&sock).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!(
                "no quiltfs server answers for {} ({}): {e}",
                mountpoint.display(),
                sock.display()
            ),
        )
    })?;
    s.write_all(format!("{what}\n").as_bytes())?;
    s.shutdown(std::net::Shutdown::Write)?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    Ok(buf)
}

/// Makes everything written to the mount durable (what syncfs would do).
pub fn sync(mountpoint: &Path) -> std::io::Result<()> {
    let reply = ask(mountpoint, "sync")?;
    if reply.trim() == "ok" {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "sync of {} failed: {}",
            mountpoint.display(),
            reply.trim()
        )))
    }
}

/// The server's counters (a JSON object, name → number).
pub fn stats(mountpoint: &Path) -> std::io::Result<serde_json::Value> {
    serde_json::from_str(&ask(mountpoint, "stats")?).map_err(std::io::Error::other)
}
