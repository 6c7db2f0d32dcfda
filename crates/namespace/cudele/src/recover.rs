//! A decoupled client that died (kill -9, a crash, a reboot) under Local Persist left
//! its journal in its local directory, and its hold on the subtree is still its own at
//! the service (a hold outlives its lease: nobody else may decouple the subtree and
//! lose those changes). Coming back as itself, with the client number and token it
//! kept beside the journal, it merges the journal durably (Nonvolatile Apply: the local
//! copy is removed after, so the service's must not be volatile) and lets the subtree
//! go. The watermark makes this safe to repeat: a recovery cut by another crash just
//! runs again.
//!
//! Files in the directory: `cudele-CLIENT.id` (the token, written and synced before
//! the client journals anything) and `cudele-CLIENT-SUBTREE.journal` (the journal).

use crate::client::Client;
use crate::journal::{self, Tail};
use crate::rpc::{Request, Response};
use quilt_vfs::Ino;
use std::io::Write;
use std::path::{Path, PathBuf};

const ID_MAGIC: &str = "quiltfs-cudele-client";

/// Where client `client` keeps its journal of `subtree` in `dir`.
pub fn journal_path(dir: &Path, client: u64, subtree: Ino) -> PathBuf {
    dir.join(format!("cudele-{client}-{subtree}.journal"))
}

fn identity_path(dir: &Path, client: u64) -> PathBuf {
    dir.join(format!("cudele-{client}.id"))
}

/// Keeps the client's number and token in `dir` (readable by its owner only), durably,
/// before the client journals anything there.
pub fn keep_identity(dir: &Path, client: u64, token: u128) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |e: std::io::Error| format!("keeping the client's identity in {}: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(io)?;
    let path = identity_path(dir, client);
    if path.exists() {
        return Ok(());
    }
    let tmp = dir.join(format!("cudele-{client}.id.new"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    writeln!(f, "{ID_MAGIC} {client} {token:032x}").map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io)
}

fn read_identity(dir: &Path, client: u64) -> Result<u128, String> {
    let path = identity_path(dir, client);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "{}: {e} (the journal's client cannot come back without it)",
            path.display()
        )
    })?;
    let mut words = text.split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some(ID_MAGIC), Some(c), Some(t)) if c.parse() == Ok(client) => {
            u128::from_str_radix(t, 16).map_err(|_| format!("{}: a damaged token", path.display()))
        }
        _ => Err(format!(
            "{}: not client {client}'s identity",
            path.display()
        )),
    }
}

/// A journal a client left in a local directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub client: u64,
    pub subtree: Ino,
    pub path: PathBuf,
}

/// The journals left in `dir` (none when it does not exist).
pub fn leftovers(dir: &Path) -> Result<Vec<Leftover>, String> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    };
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = e.file_name();
        let Some(stem) = name
            .to_str()
            .and_then(|n| n.strip_prefix("cudele-"))
            .and_then(|n| n.strip_suffix(".journal"))
        else {
            continue;
        };
        if let Some((c, s)) = stem.split_once('-') {
            if let (Ok(client), Ok(subtree)) = (c.parse(), s.parse()) {
                out.push(Leftover {
                    client,
                    subtree,
                    path: e.path(),
                });
            }
        }
    }
    out.sort_by_key(|l| (l.client, l.subtree));
    Ok(out)
}

/// What a recovery did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Events of the journal merged now (those before the watermark were already).
    pub events: u64,
    /// The journal's last event.
    pub last_seq: u64,
    /// Bytes of a torn last frame dropped (an append cut by the crash, never
    /// acknowledged).
    pub torn_bytes: u64,
}

/// Comes back as the client that left `left` in `dir` at the service `addr`, merges
/// its journal durably, releases its hold, and removes the journal (and the identity,
/// once no journal of that client is left).
pub fn recover(
    addr: &str,
    secret: &str,
    ca_pem: Option<Vec<u8>>,
    dir: &Path,
    left: &Leftover,
) -> Result<Recovered, String> {
    let token = read_identity(dir, left.client)?;
    let shown = left.path.display();
    let bytes = std::fs::read(&left.path).map_err(|e| format!("{shown}: {e}"))?;
    let read = journal::read(&bytes, Tail::MayBeTorn).map_err(|e| format!("{shown}: {e}"))?;
    if read.header.client != left.client || read.header.subtree != left.subtree {
        return Err(format!(
            "{shown} holds client {}'s journal of subtree {}, not what its name says",
            read.header.client, read.header.subtree
        ));
    }
    let c = Client::rejoin(addr, secret, ca_pem, left.client, token)?;
    let refused = |what: &str, e: quilt_vfs::WireError| format!("{what}: {}", e.message);
    let merged_seq = match c
        .call(Request::Decouple {
            client: left.client,
            ino: left.subtree,
        })
        .map_err(|e| refused("taking the subtree back", e))?
    {
        Response::Decoupled { merged_seq, .. } => merged_seq,
        r => return Err(format!("taking the subtree back: {r:?}")),
    };
    let last_seq = read.events.last().map_or(0, |(s, _)| *s);
    let mut done = Recovered {
        events: 0,
        last_seq,
        torn_bytes: read.torn_bytes,
    };
    if last_seq > merged_seq {
        let whole = &bytes[..bytes.len() - read.torn_bytes as usize];
        match c
            .call(Request::Merge {
                client: left.client,
                subtree: left.subtree,
                journal: whole.to_vec(),
                durable: true,
            })
            .map_err(|e| refused("the merge", e))?
        {
            Response::Merged { events, .. } => done.events = events,
            r => return Err(format!("the merge: {r:?}")),
        }
    }
    c.call(Request::Release {
        client: left.client,
        subtree: left.subtree,
    })
    .map_err(|e| refused("letting the subtree go", e))?;
    std::fs::remove_file(&left.path).map_err(|e| format!("{shown}: {e}"))?;
    let others = leftovers(dir)?.iter().any(|l| l.client == left.client);
    if !others {
        let _ = std::fs::remove_file(identity_path(dir, left.client));
    }
    Ok(done)
}
