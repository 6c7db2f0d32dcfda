//! Progress of a long command: a bar with an estimate on a terminal, and otherwise a
//! plain line on stderr every so often (every 10 s, or QUILTFS_PROGRESS_SECS), so logs
//! of piped or unattended runs show where they are without control characters.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

pub struct Meter {
    bar: indicatif::ProgressBar,
    tty: bool,
    what: &'static str,
    unit: &'static str,
    start: Instant,
    last_line: Instant,
    every: Duration,
    done: u64,
    total: u64,
    /// What the last plain line said was done (None: no line yet).
    printed: Option<u64>,
}

impl Meter {
    /// `what` names the command in plain lines ("mkfs"); `unit` what is counted.
    pub fn new(what: &'static str, unit: &'static str, total: u64) -> Meter {
        let tty = std::io::stderr().is_terminal();
        let bar = if tty {
            indicatif::ProgressBar::new(total)
        } else {
            indicatif::ProgressBar::hidden()
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(&format!(
                "{{spinner}} [{{elapsed_precise}}] {{bar:30}} {{pos}}/{{len}} {unit}, {{eta}} left  {{msg}}"
            ))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let every = std::env::var("QUILTFS_PROGRESS_SECS")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(Duration::from_secs(10));
        let now = Instant::now();
        Meter {
            bar,
            tty,
            what,
            unit,
            start: now,
            last_line: now,
            every,
            done: 0,
            total,
            printed: None,
        }
    }

    /// How far it is: `done` of `total`, with a note on what it is doing.
    pub fn set(&mut self, done: u64, total: u64, note: &str) {
        self.done = done;
        self.total = total;
        if self.tty {
            self.bar.set_length(total);
            self.bar.set_position(done);
            self.bar.set_message(note.to_string());
            return;
        }
        if self.last_line.elapsed() < self.every {
            return;
        }
        self.last_line = Instant::now();
        self.line(note);
    }

    fn line(&mut self, note: &str) {
        self.printed = Some(self.done);
        let secs = self.start.elapsed().as_secs_f64();
        let left = if self.done > 0 && self.done < self.total {
            let s = secs / self.done as f64 * (self.total - self.done) as f64;
            format!(", about {s:.0} s left")
        } else {
            String::new()
        };
        let note = if note.is_empty() {
            String::new()
        } else {
            format!(" ({note})")
        };
        eprintln!(
            "{}: {}/{} {} in {secs:.0} s{left}{note}",
            self.what, self.done, self.total, self.unit
        );
    }

    /// The end: the bar is cleared; off a terminal a last line says where it ended, if
    /// lines were printed and the last did not say so already.
    pub fn finish(&mut self) {
        self.bar.finish_and_clear();
        if !self.tty && self.printed.is_some_and(|d| d != self.done) {
            self.line("done");
        }
    }
}
