//! Handing the CPU to the caller with each answer (FUSE over io_uring).
//!
//! Why: a ring worker answers on its caller's CPU, and the answer wakes the caller
//! while the worker is still running there. The scheduler then places the caller on
//! another CPU if one is idle, its next request lands on that CPU's queue, and every
//! round trip pays a wakeup of an idle CPU (an interrupt between vCPUs in a VM). On
//! this machine a 20,000-file untar took 7.4-8.3 s that way, 3.1 s when the other CPU
//! was busy with anything else (the caller then stays put). A CPU whose only runnable
//! task has the `SCHED_IDLE` policy counts as idle to the wakeup placement, and a
//! waking task preempts such a task at once: so a worker submits its answers under
//! `SCHED_IDLE`, the caller is woken on the worker's CPU, and its next request is
//! served there without a cross-CPU wakeup. The worker then waits for that request as
//! a normal thread.
//!
//! The cost: a `SCHED_IDLE` worker that other tasks compete with for its CPU waits
//! longer to be picked (a first version that also waited under `SCHED_IDLE`: the same
//! untar with two busy loops beside it 4.4 s against 3.3 s, with four 5.6 s against
//! 3.8 s). So the policy is used only while the machine has at least half a CPU idle
//! (sampled from /proc/stat at most every 100 ms): when every CPU is busy the caller
//! stays on its CPU anyway. That is not enough to make it a default: in the full
//! benchmark (83,731 entries, the server's own flusher writing back throughout) the
//! untar was no faster (25.04 s against 23.91 s) and the delete slower (6.66 s against
//! 6.04 s), the caller mostly staying put anyway and the worker waiting behind the
//! flusher and the kernel's writeback threads; a 20,000-entry untar alone, with little
//! write-back, took 4.0-4.2 s against 7.2-8.2 s. So it is a mount option.
//!
//! Switching back from `SCHED_IDLE` needs CAP_SYS_NICE or an RLIMIT_NICE that allows
//! nice 0, so it is probed once on a throwaway thread; an unprivileged server that may
//! not switch back never switches.

use io_uring::{cqueue, squeue, IoUring};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// How often the machine's idle time is sampled.
const SAMPLE_MS: u64 = 100;

/// Counters of how ring workers waited.
#[derive(Debug, Default)]
pub struct RingStats {
    handed: AtomicU64,
    waits: AtomicU64,
}

impl RingStats {
    /// Waits made under `SCHED_IDLE`, handing the CPU to the caller.
    pub fn handed_off(&self) -> u64 {
        self.handed.load(Relaxed)
    }
    /// Every wait of a ring worker for its next request.
    pub fn waits(&self) -> u64 {
        self.waits.load(Relaxed)
    }
}

/// The decision shared by a session's ring workers.
pub(crate) struct Handoff {
    permitted: bool,
    on: AtomicBool,
    start: Instant,
    next_sample_ms: AtomicU64,
    /// Idle and total jiffies at the last sample.
    last: Mutex<Option<(u64, u64)>>,
    cpus: u64,
    pub(crate) stats: std::sync::Arc<RingStats>,
}

impl Handoff {
    pub(crate) fn new(wanted: bool, stats: std::sync::Arc<RingStats>) -> Handoff {
        let permitted = wanted && probe();
        if wanted && !permitted {
            tracing::info!(
                "FUSE ring: workers may not return from SCHED_IDLE (no CAP_SYS_NICE); answers \
                 do not hand the CPU to the caller"
            );
        }
        Handoff {
            permitted,
            on: AtomicBool::new(false),
            start: Instant::now(),
            next_sample_ms: AtomicU64::new(0),
            last: Mutex::new(None),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
            stats,
        }
    }

    /// A worker's submit-and-wait on its ring: one call, or when handing off, the
    /// answers (which wake their callers) submitted under `SCHED_IDLE` and then the wait
    /// as a normal thread. Only the submission is idle: a worker woken for its next
    /// request must not wait behind other threads of its CPU (the server's flusher, the
    /// kernel's writeback).
    pub(crate) fn submit_and_wait(
        &self,
        ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
    ) -> io::Result<usize> {
        self.stats.waits.fetch_add(1, Relaxed);
        if ring.submission().is_empty() || !self.active() {
            return ring.submit_and_wait(1);
        }
        self.stats.handed.fetch_add(1, Relaxed);
        set_policy(libc::SCHED_IDLE);
        // A failed submission is retried by the wait below.
        let _ = ring.submit();
        if !set_policy(libc::SCHED_OTHER) {
            tracing::warn!("FUSE ring: could not leave SCHED_IDLE");
        }
        ring.submit_and_wait(1)
    }

    fn active(&self) -> bool {
        if !self.permitted {
            return false;
        }
        let now = self.start.elapsed().as_millis() as u64;
        if now >= self.next_sample_ms.load(Relaxed) {
            if let Ok(mut last) = self.last.try_lock() {
                self.next_sample_ms.store(now + SAMPLE_MS, Relaxed);
                if let Some(cur) = cpu_jiffies() {
                    if let Some(prev) = *last {
                        let idle = cur.0.saturating_sub(prev.0);
                        let total = cur.1.saturating_sub(prev.1);
                        // Idle CPUs = idle share × CPUs; at least half a CPU idle.
                        let spare = total > 0 && idle * self.cpus * 2 >= total;
                        self.on.store(spare, Relaxed);
                    }
                    *last = Some(cur);
                }
            }
        }
        self.on.load(Relaxed)
    }
}

fn set_policy(policy: i32) -> bool {
    let p = libc::sched_param { sched_priority: 0 };
    // SAFETY: a valid sched_param; 0 is the calling thread.
    unsafe { libc::sched_setscheduler(0, policy, &p) == 0 }
}

/// Whether a thread may go to `SCHED_IDLE` and come back (tried on a thread of its own,
/// which is left behind if it could not come back).
fn probe() -> bool {
    std::thread::spawn(|| set_policy(libc::SCHED_IDLE) && set_policy(libc::SCHED_OTHER))
        .join()
        .unwrap_or(false)
}

/// Idle (idle + iowait) and total jiffies of all CPUs, from /proc/stat's first line.
fn cpu_jiffies() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    parse_cpu_line(text.lines().next()?)
}

fn parse_cpu_line(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    // user nice system idle iowait irq softirq steal (guest times are inside user).
    let v: Vec<u64> = fields
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 5 {
        return None;
    }
    Some((v[3] + v[4], v.iter().sum()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_lines() {
        assert_eq!(
            parse_cpu_line("cpu  817160 117511 1639780 1320547 133365 0 8525 9602 0 0"),
            Some((
                1320547 + 133365,
                817160 + 117511 + 1639780 + 1320547 + 133365 + 8525 + 9602
            ))
        );
        assert_eq!(parse_cpu_line("cpu0 1 2 3 4 5 6 7 8"), None);
        assert_eq!(parse_cpu_line("cpu 1 2 x 4 5"), None);
        assert_eq!(parse_cpu_line("cpu 1 2"), None);
    }

    #[test]
    fn reads_this_machine() {
        let (idle, total) = cpu_jiffies().expect("/proc/stat");
        assert!(total >= idle && total > 0);
    }
}
