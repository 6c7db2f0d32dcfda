//! The metadata service's messages (postcard over gRPC, `transport.rs`). Errors are
//! errnos with a message ([`WireError`]): a mount turns them into the caller's errno.

use crate::policy::Policy;
use quilt_vfs::{Attr, Ctx, FsOp, FsReply, Ino, InoGrant, WireError};
use serde::{Deserialize, Serialize};

/// The largest message: a client journal of a few million events, or a 4 MiB write.
pub const MAX_MESSAGE: usize = 256 << 20;

/// Who asks: a client's caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub umask: u32,
}

impl From<&Ctx> for Creds {
    fn from(c: &Ctx) -> Creds {
        Creds {
            uid: c.uid,
            gid: c.gid,
            pid: c.pid,
            umask: c.umask,
        }
    }
}

impl From<Creds> for Ctx {
    fn from(c: Creds) -> Ctx {
        Ctx {
            uid: c.uid,
            gid: c.gid,
            pid: c.pid,
            umask: c.umask,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// A new client: the service gives it a number (never given before, restarts
    /// included) and a lease.
    Hello { name: String },
    /// The client is alive: its lease (and its holds') goes on.
    Renew { client: u64 },
    /// One file-system operation (RPCs).
    Op { client: u64, creds: Creds, op: FsOp },
    /// The directory at `path` (bytes, `/`-separated, from the namespace's root).
    Resolve { client: u64, path: Vec<u8> },
    /// The policy that governs directory `ino`.
    PolicyGet { client: u64, ino: Ino },
    /// Changes directory `ino`'s policy (`KEY=VALUE` words, `Policy::set`).
    PolicySet {
        client: u64,
        ino: Ino,
        settings: String,
    },
    /// Decouples the subtree at `ino` for the client: a hold, granted numbers.
    Decouple { client: u64, ino: Ino },
    /// More numbers for a held subtree.
    MoreInodes { client: u64, subtree: Ino },
    /// A client journal (the bytes of `journal.rs`) applied to the namespace: Volatile
    /// Apply, or with `durable` Nonvolatile Apply (made durable before the answer).
    Merge {
        client: u64,
        subtree: Ino,
        #[serde(with = "serde_bytes")]
        journal: Vec<u8>,
        durable: bool,
    },
    /// Global Persist: frames of a client journal kept on the service's durable
    /// storage (checksummed, not applied), appended to what was persisted before.
    Persist {
        client: u64,
        subtree: Ino,
        #[serde(with = "serde_bytes")]
        journal: Vec<u8>,
    },
    /// The client lets go of a subtree (after its last merge).
    Release { client: u64, subtree: Ino },
    /// Everything durable.
    Sync { client: u64 },
    /// A client that died comes back as itself (its token in the request's metadata,
    /// kept beside its local journal): the same welcome, its holds still its own.
    Rejoin { client: u64 },
    /// The client holds the subtree at `ino` while it uses it through RPCs (a mount of
    /// it as its root): under interfere=block every other client's request inside it
    /// gets EBUSY until `Release`; nothing is granted or merged.
    Hold { client: u64, ino: Ino },
    /// A handle on file `ino` for the client: an unlinked file lives at the service
    /// until the client's last `Close` of it (or until the client's lease lapses).
    Open { client: u64, ino: Ino },
    /// Handles the client let go of (one `Open` each).
    Close { client: u64, inos: Vec<Ino> },
    /// A `Mknod` (`op`) whose new file is opened for the client in the same request:
    /// the kernel's CREATE in one round trip.
    CreateOpen { client: u64, creds: Creds, op: FsOp },
}

/// What a `PolicyGet`/`PolicySet` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyInfo {
    /// The directory whose policy governs (the asked one, or its nearest ancestor
    /// with a policy; the namespace's root when none has one).
    pub from: Ino,
    pub policy: Policy,
    /// Changes made to it (0: the default, never set).
    pub version: u64,
    /// The client holding the asked directory's subtree (decoupled, or for its RPCs),
    /// if one does.
    pub holder: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Welcome {
        client: u64,
        /// Carried by every later request of the client (in its metadata).
        token: u128,
        root: Ino,
        lease_ms: u64,
    },
    Reply(FsReply),
    Attr(Attr),
    Policy(PolicyInfo),
    Decoupled {
        policy: Policy,
        grants: Vec<InoGrant>,
        /// The last event of this client's journal merged here, and the highest
        /// number used: a journal goes on from there.
        merged_seq: u64,
        max_ino: Ino,
    },
    Granted(Vec<InoGrant>),
    Merged {
        merged_seq: u64,
        events: u64,
        skipped: u64,
        moved_aside: u64,
    },
    Persisted {
        bytes: u64,
    },
    Done,
    Error(WireError),
}

/// The kinds of request, in `Request::kind`'s numbering (the service counts them).
pub const REQUEST_KINDS: [&str; 17] = [
    "hello",
    "renew",
    "op",
    "resolve",
    "policy_get",
    "policy_set",
    "decouple",
    "more_inodes",
    "merge",
    "persist",
    "release",
    "sync",
    "rejoin",
    "hold",
    "open",
    "close",
    "create_open",
];

impl Request {
    /// This request's index in `REQUEST_KINDS`.
    pub fn kind(&self) -> usize {
        match self {
            Request::Hello { .. } => 0,
            Request::Renew { .. } => 1,
            Request::Op { .. } => 2,
            Request::Resolve { .. } => 3,
            Request::PolicyGet { .. } => 4,
            Request::PolicySet { .. } => 5,
            Request::Decouple { .. } => 6,
            Request::MoreInodes { .. } => 7,
            Request::Merge { .. } => 8,
            Request::Persist { .. } => 9,
            Request::Release { .. } => 10,
            Request::Sync { .. } => 11,
            Request::Rejoin { .. } => 12,
            Request::Hold { .. } => 13,
            Request::Open { .. } => 14,
            Request::Close { .. } => 15,
            Request::CreateOpen { .. } => 16,
        }
    }
}
