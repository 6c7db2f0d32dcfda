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
//! write-back, took 4.0-4.2 s against 7.2-8.2 s.
//!
//! What decides is whether callers actually ping-pong, and that can be counted: a
//! request whose caller's last request came on another CPU's queue has migrated. An
//! untar that stays put migrates about 1% of its requests; Dovecot moving mail with its
//! fsyncs off, or turned into patchgroups, 86%, and some untar runs fell into it as well
//! (68%: 37 s instead of 10 s). So the default (`Auto`, see [`Handoff`]) hands off only
//! while a window shows ping-pong; `handoff` and `nohandoff` force it on or off.
//!
//! Switching back from `SCHED_IDLE` needs CAP_SYS_NICE or an RLIMIT_NICE that allows
//! nice 0, so it is probed once on a throwaway thread; an unprivileged server that may
//! not switch back never switches.

use io_uring::{cqueue, squeue, IoUring};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// How often the machine's idle time is sampled.
const SAMPLE_MS: u64 = 100;

/// Counters of how ring workers waited.
#[derive(Debug, Default)]
pub struct RingStats {
    handed: AtomicU64,
    waits: AtomicU64,
    migrated: AtomicU64,
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
    /// Requests whose caller's previous request came on another CPU's queue: the
    /// caller was woken on, or moved to, another CPU in between.
    pub fn migrated(&self) -> u64 {
        self.migrated.load(Relaxed)
    }
}

/// When ring workers hand the CPU to their callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffMode {
    /// Never.
    Never,
    /// While callers ping-pong between CPUs (most requests come on another CPU's queue
    /// than their caller's last one) and some CPU is idle; see [`Handoff`].
    Auto,
    /// Whenever some CPU is idle.
    Always,
}

/// The decision shared by a session's ring workers.
///
/// `Auto` watches for the caller and its worker ping-ponging between CPUs. A caller
/// woken on the idle CPU makes its next request there, to that CPU's queue; its
/// answer wakes it on the CPU just left, and so on: every round trip wakes a halted
/// vCPU. Dovecot moving mail with its fsyncs off (or turned into patchgroups) did that
/// for 86% of its requests, and so did some runs of an untar (the same untar took 10 s
/// or 37 s). Handing off stops it (the mail move: 5.0 s -> 2.4 s), but where callers
/// already stay put it only costs (two policy switches per answer, and a worker that
/// waits behind the others of its CPU: untar 12.7 s against 13.7 s). So it is engaged
/// only while a window of [`SAMPLE_MS`] shows ping-pong; once engaged the ping-pong
/// cannot be seen, so every `hold` windows one window is served without it, and `hold`
/// doubles each time that window shows ping-pong again.
pub(crate) struct Handoff {
    mode: HandoffMode,
    on: AtomicBool,
    start: Instant,
    next_sample_ms: AtomicU64,
    control: Mutex<Control>,
    cpus: u64,
    /// The queue each caller's last request came on, by pid modulo the table's size
    /// (a collision only miscounts).
    last_queue: Box<[AtomicU16]>,
    /// Requests, and those that migrated, since the last sample.
    window: [AtomicU64; 2],
    pub(crate) stats: std::sync::Arc<RingStats>,
}

/// What the sampler keeps between windows.
#[derive(Debug, Default)]
struct Control {
    /// Idle and total jiffies at the last sample.
    jiffies: Option<(u64, u64)>,
    /// Windows served with the handoff engaged since it was engaged, and how many to
    /// serve before a window without it.
    on_windows: u32,
    hold: u32,
    /// The window just ended was a probe (served without, after windows with).
    probing: bool,
}

/// Callers tracked for migrations.
const CALLERS: usize = 4096;
/// A window shows ping-pong when at least this many requests came in it and a quarter
/// of them migrated (an untar that stays put: about 1%; ping-pong: 68-86%).
const PINGPONG_MIN_REQUESTS: u64 = 50;
/// Windows the handoff stays engaged before the first probe, and at most.
const HOLD_FIRST: u32 = 10;
const HOLD_MAX: u32 = 80;

impl Handoff {
    pub(crate) fn new(wanted: HandoffMode, stats: std::sync::Arc<RingStats>) -> Handoff {
        let mode = if wanted != HandoffMode::Never && !probe() {
            tracing::info!(
                "FUSE ring: workers may not return from SCHED_IDLE (no CAP_SYS_NICE); answers \
                 do not hand the CPU to the caller"
            );
            HandoffMode::Never
        } else {
            wanted
        };
        Handoff {
            mode,
            on: AtomicBool::new(false),
            start: Instant::now(),
            next_sample_ms: AtomicU64::new(0),
            control: Mutex::new(Control {
                hold: HOLD_FIRST,
                ..Control::default()
            }),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
            last_queue: (0..CALLERS).map(|_| AtomicU16::new(u16::MAX)).collect(),
            window: [AtomicU64::new(0), AtomicU64::new(0)],
            stats,
        }
    }

    /// Notes that a request of caller `pid` came on queue `qid`.
    pub(crate) fn arrived(&self, pid: u32, qid: u16) {
        if pid == 0 {
            // The kernel's own (write-back of cached pages): no caller waits on it.
            return;
        }
        let before = self.last_queue[pid as usize % CALLERS].swap(qid, Relaxed);
        self.window[0].fetch_add(1, Relaxed);
        if before != qid && before != u16::MAX {
            self.window[1].fetch_add(1, Relaxed);
            self.stats.migrated.fetch_add(1, Relaxed);
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
        if self.mode == HandoffMode::Never {
            return false;
        }
        let now = self.start.elapsed().as_millis() as u64;
        if now >= self.next_sample_ms.load(Relaxed) {
            if let Ok(mut c) = self.control.try_lock() {
                self.next_sample_ms.store(now + SAMPLE_MS, Relaxed);
                let requests = self.window[0].swap(0, Relaxed);
                let migrated = self.window[1].swap(0, Relaxed);
                if let Some(cur) = cpu_jiffies() {
                    if let Some(prev) = c.jiffies {
                        let idle = cur.0.saturating_sub(prev.0);
                        let total = cur.1.saturating_sub(prev.1);
                        // Idle CPUs = idle share × CPUs; at least half a CPU idle.
                        let spare = total > 0 && idle * self.cpus * 2 >= total;
                        let on = match self.mode {
                            HandoffMode::Always => spare,
                            _ => {
                                c.decide(self.on.load(Relaxed), pingpong(requests, migrated), spare)
                            }
                        };
                        self.on.store(on, Relaxed);
                    }
                    c.jiffies = Some(cur);
                }
            }
        }
        self.on.load(Relaxed)
    }
}

/// Whether a window's requests show callers ping-ponging between CPUs.
fn pingpong(requests: u64, migrated: u64) -> bool {
    requests >= PINGPONG_MIN_REQUESTS && migrated * 4 >= requests
}

impl Control {
    /// `Auto`: whether the next window is served with the handoff, given whether the
    /// window just ended was, and what it showed.
    fn decide(&mut self, was_on: bool, pingpong: bool, spare: bool) -> bool {
        if was_on {
            self.on_windows += 1;
            if self.on_windows < self.hold && spare {
                return true;
            }
            // A probe (or no idle CPU to hand off to): the next window shows whether
            // the callers still ping-pong without it.
            self.on_windows = 0;
            self.probing = spare;
            return false;
        }
        let on = pingpong && spare;
        self.hold = match (on, self.probing) {
            (true, true) => (self.hold * 2).min(HOLD_MAX),
            _ => HOLD_FIRST,
        };
        self.probing = false;
        on
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
    fn auto_engages_on_pingpong_and_probes_ever_less_often() {
        assert!(!pingpong(
            PINGPONG_MIN_REQUESTS - 1,
            PINGPONG_MIN_REQUESTS - 1
        ));
        assert!(!pingpong(1000, 249));
        assert!(pingpong(1000, 250));
        let mut c = Control {
            hold: HOLD_FIRST,
            ..Control::default()
        };
        // Callers that stay put, or no idle CPU: never engaged.
        assert!(!c.decide(false, false, true));
        assert!(!c.decide(false, true, false));
        // Ping-pong: engaged for HOLD_FIRST windows, then one probe window.
        let mut on = c.decide(false, true, true);
        let mut pattern = Vec::new();
        for _ in 0..(HOLD_FIRST + HOLD_FIRST * 2 + 2) {
            pattern.push(on);
            // While engaged the callers stay put; a probe window shows ping-pong again.
            on = c.decide(on, !on, true);
        }
        let first_off = pattern.iter().position(|&o| !o).unwrap();
        assert_eq!(first_off, HOLD_FIRST as usize);
        let second_off = first_off + 1 + pattern[first_off + 1..].iter().position(|&o| !o).unwrap();
        assert_eq!(second_off - first_off - 1, 2 * HOLD_FIRST as usize);
        // A probe that shows the callers staying put disengages, and the hold starts over.
        let mut c = Control {
            hold: HOLD_FIRST,
            ..Control::default()
        };
        let mut on = c.decide(false, true, true);
        for _ in 0..HOLD_FIRST {
            on = c.decide(on, false, true);
        }
        assert!(!on);
        assert!(!c.decide(false, false, true));
        assert_eq!(c.hold, HOLD_FIRST);
        // Engaged, the idle CPU gone: off at once.
        let mut c = Control {
            hold: HOLD_FIRST,
            ..Control::default()
        };
        assert!(c.decide(false, true, true));
        assert!(!c.decide(true, false, false));
    }

    #[test]
    fn reads_this_machine() {
        let (idle, total) = cpu_jiffies().expect("/proc/stat");
        assert!(total >= idle && total > 0);
    }
}
