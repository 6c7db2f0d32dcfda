//! Who a FUSE request works for, as patchgroups see it.
//!
//! The kernel tags each request with the calling *thread's* id; patchgroup engagement is
//! per *process*, so requests are keyed by thread-group id, read from /proc. Processes
//! that take part in patchgroups (they made a call on the control file, or their parent
//! had groups engaged when they first showed up: fork inheritance, as far as FUSE lets us
//! see it) are watched through a pidfd; when one exits, its engagements are dropped and
//! the groups it created are abandoned, so a crashed program cannot pin the cache.
//!
//! Until the first patchgroup call nothing is resolved: a request's caller is its thread
//! id, which no group can have engaged, and no /proc read is made.

use quilt_vfs::{KernelFs, PgId};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a thread-to-process answer is trusted (thread ids are reused).
const TID_TTL: Duration = Duration::from_secs(1);

/// A process taking part in patchgroups.
struct Member {
    /// Readable once the process has exited.
    pidfd: Option<OwnedFd>,
    /// Groups it created: abandoned when it exits.
    owned: Vec<PgId>,
    /// The message of its last failed patchgroup call.
    last_error: String,
}

#[derive(Default)]
struct Inner {
    tgid_of: HashMap<u32, (u32, Instant)>,
    members: HashMap<u32, Member>,
}

pub(crate) struct Callers {
    active: AtomicBool,
    inner: Mutex<Inner>,
    stop: Arc<AtomicBool>,
}

impl Default for Callers {
    fn default() -> Self {
        Callers {
            active: AtomicBool::new(false),
            inner: Mutex::default(),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// The thread-group id and parent of `tid`, from /proc.
fn proc_status(tid: u32) -> Option<(u32, u32)> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    let field = |name: &str| -> Option<u32> {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    Some((field("Tgid:")?, field("PPid:")?))
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the descriptor was just created and is owned by nothing else.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl Callers {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The caller id of a request from thread `tid` (0: the kernel itself, as for
    /// writeback). A process seen for the first time inherits its parent's engagements.
    pub fn caller(&self, tid: u32, fs: &dyn KernelFs) -> u64 {
        if tid == 0 || !self.active.load(Ordering::Relaxed) {
            return tid as u64;
        }
        let mut g = self.lock();
        let now = Instant::now();
        if let Some(&(tgid, at)) = g.tgid_of.get(&tid) {
            if now.duration_since(at) < TID_TTL {
                return tgid as u64;
            }
        }
        let Some((tgid, ppid)) = proc_status(tid) else {
            return tid as u64;
        };
        if g.tgid_of.len() > 4096 {
            g.tgid_of
                .retain(|_, (_, at)| now.duration_since(*at) < TID_TTL);
        }
        g.tgid_of.insert(tid, (tgid, now));
        if !g.members.contains_key(&tgid) && g.members.contains_key(&ppid) {
            // A child of a member: it starts inside its parent's groups.
            fs.pg_inherit(ppid as u64, tgid as u64);
            g.members.insert(
                tgid,
                Member {
                    pidfd: pidfd_open(tgid),
                    owned: Vec::new(),
                    last_error: String::new(),
                },
            );
        }
        tgid as u64
    }

    /// Makes the process of `tid` a member (it is about to make a patchgroup call) and
    /// returns its caller id.
    pub fn join(&self, tid: u32, fs: &dyn KernelFs) -> u64 {
        self.active.store(true, Ordering::Relaxed);
        let c = self.caller(tid, fs);
        let mut g = self.lock();
        g.members.entry(c as u32).or_insert_with(|| Member {
            pidfd: pidfd_open(c as u32),
            owned: Vec::new(),
            last_error: String::new(),
        });
        c
    }

    pub fn owns(&self, caller: u64, pg: PgId) {
        if let Some(m) = self.lock().members.get_mut(&(caller as u32)) {
            m.owned.push(pg);
        }
    }

    /// `pg` was abandoned (by anyone): no exit needs to abandon it again.
    pub fn disown(&self, pg: PgId) {
        for m in self.lock().members.values_mut() {
            m.owned.retain(|&x| x != pg);
        }
    }

    pub fn set_error(&self, caller: u64, what: String) {
        if let Some(m) = self.lock().members.get_mut(&(caller as u32)) {
            m.last_error = what;
        }
    }

    pub fn last_error(&self, caller: u64) -> String {
        self.lock()
            .members
            .get(&(caller as u32))
            .map(|m| m.last_error.clone())
            .unwrap_or_default()
    }

    /// Members whose process has exited, removed from the table.
    fn reap(&self) -> Vec<(u32, Member)> {
        let mut g = self.lock();
        let mut fds: Vec<(u32, libc::pollfd)> = g
            .members
            .iter()
            .filter_map(|(&p, m)| {
                m.pidfd.as_ref().map(|fd| {
                    (
                        p,
                        libc::pollfd {
                            fd: fd.as_raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        },
                    )
                })
            })
            .collect();
        if fds.is_empty() {
            return Vec::new();
        }
        let mut raw: Vec<libc::pollfd> = fds.iter().map(|(_, p)| *p).collect();
        // SAFETY: `raw` is a valid array of pollfds for the duration of the call; a zero
        // timeout makes it a check.
        let n = unsafe { libc::poll(raw.as_mut_ptr(), raw.len() as libc::nfds_t, 0) };
        if n <= 0 {
            return Vec::new();
        }
        for (slot, r) in fds.iter_mut().zip(&raw) {
            slot.1.revents = r.revents;
        }
        let gone: Vec<u32> = fds
            .iter()
            .filter(|(_, p)| p.revents != 0)
            .map(|(pid, _)| *pid)
            .collect();
        g.tgid_of.retain(|_, (tgid, _)| !gone.contains(tgid));
        gone.into_iter()
            .filter_map(|p| g.members.remove(&p).map(|m| (p, m)))
            .collect()
    }

    /// Drops what exited processes left: their engagements, and the groups they made.
    pub fn release_exited(&self, fs: &dyn KernelFs) -> usize {
        let gone = self.reap();
        let n = gone.len();
        for (pid, m) in gone {
            fs.pg_forget_caller(pid as u64);
            for pg in m.owned {
                match fs.pg_abandon(pg) {
                    Ok(()) => tracing::debug!("process {pid} exited: patchgroup {pg} abandoned"),
                    Err(e) => tracing::debug!("process {pid} exited; patchgroup {pg}: {e}"),
                }
            }
        }
        n
    }

    /// Starts a thread that releases the groups of exited processes every `period`,
    /// until the returned guard is dropped.
    pub fn watch<F: KernelFs + 'static>(self: &Arc<Self>, fs: Arc<F>, period: Duration) -> Watcher {
        let me = Arc::downgrade(self);
        let stop = self.stop.clone();
        let h = std::thread::Builder::new()
            .name("quiltfs-pg-reaper".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // Parked, not asleep: dropping the watcher wakes it, so unmounting
                    // does not wait out a period.
                    std::thread::park_timeout(period);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Some(c) = me.upgrade() else { break };
                    if c.active.load(Ordering::Relaxed) {
                        c.release_exited(fs.as_ref());
                    }
                }
            })
            .ok();
        Watcher {
            stop: self.stop.clone(),
            thread: h,
        }
    }
}

/// Stops the reaper thread when dropped.
pub(crate) struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.thread.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}
