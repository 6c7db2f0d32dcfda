//! Use case 2 (the paper's figure 5b): clients create files in private directories
//! through RPCs with the paper's settings (strong consistency, global durability:
//! CephFS's own behaviour), while a *rogue* client creates files in every one of
//! them. Three cases, each against the same clients:
//!
//! - `none`: no rogue (interfere=allow, nobody else comes);
//! - `allow`: interfere=allow, the rogue's creates go in beside the clients';
//! - `block`: interfere=block, each client holds its directory (`Client::hold`, what a
//!   mount of it as its root does), so the rogue gets EBUSY for every request.
//!
//! Each case reports the slowest client's time ÷ one client's time alone (the same
//! settings, measured in the same run): the paper's "slowdown per client".
//!
//! The paper's rogue was a client on its own machine; here every process shares two
//! cores. So the rogue is paced at the rate one client reaches alone (one that ignores
//! EBUSY and asks again at once would take a core of its own: a refusal costs far less
//! than a create), and runs at the lowest CPU priority, so that its own side of each
//! request yields to the clients: what remains is the service's work for its requests,
//! which is what the case measures.

use super::{client_output, now_ms, spawn_client, subtree, user, ClientArgs, Row, Service};
use anyhow::{anyhow, bail, Result};
use quilt_cudele::client::{Client, RemoteFs};
use quilt_vfs::{FileSystem, FsError, Ino};
use std::path::Path;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The cases, in the order they run.
pub const CASES: [&str; 3] = ["none", "allow", "block"];

/// What the rogue did in one case.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Rogue {
    pub case: String,
    pub run: usize,
    /// Creates the service accepted.
    pub accepted: u64,
    /// Refused with EBUSY.
    pub refused: u64,
}

fn settings(case: &str) -> &'static str {
    match case {
        "block" => "consistency=strong durability=global interfere=block",
        _ => "consistency=strong durability=global interfere=allow",
    }
}

/// A client process of use case 2: `n` creates through RPCs in its own directory,
/// held for the run under `block`; prints `start end` (ms).
pub fn client(c: &Arc<Client>, a: &ClientArgs, case: &str) -> Result<()> {
    let root = subtree(c, &a.dir, settings(case))?;
    if case == "block" {
        c.hold(root)
            .map_err(|e| anyhow!("holding {}: {e}", a.dir))?;
    }
    let remote = RemoteFs::new(c.clone());
    std::thread::sleep(Duration::from_millis(a.start_ms.saturating_sub(now_ms())));
    let start = now_ms();
    for i in 0..a.n {
        remote
            .mknod(root, &super::name(i), libc::S_IFREG | 0o644, 0, &user())
            .map_err(|e| anyhow!("create {i}: {e}"))?;
    }
    let end = now_ms();
    println!("{start} {end}");
    // The hold lasts until the bench says every client is done (the end of standard
    // input): a client done early must not let the rogue in beside the others.
    use std::io::{Read, Write};
    std::io::stdout().flush()?;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    if case == "block" {
        c.let_go(root).map_err(|e| anyhow!("letting go: {e}"))?;
    }
    Ok(())
}

/// The rogue: from `start_ms`, creates in each of the directories `a.dir` names
/// (comma-separated) in turn, at most `a.rate` a second (0: unpaced), until the file
/// `a.until` exists, `a.n` attempts, or ten minutes. Prints `accepted refused`.
pub fn rogue(c: &Arc<Client>, a: &ClientArgs) -> Result<()> {
    let remote = RemoteFs::new(c.clone());
    let until = a
        .until
        .as_ref()
        .ok_or_else(|| anyhow!("the rogue needs --until FILE"))?;
    std::thread::sleep(Duration::from_millis(a.start_ms.saturating_sub(now_ms())));
    // The clients made their directories before the start.
    let dirs: Vec<Ino> = a
        .dir
        .split(',')
        .map(|d| {
            c.resolve(d.as_bytes())
                .map(|attr| attr.ino)
                .map_err(|e| anyhow!("the rogue resolving {d}: {e}"))
        })
        .collect::<Result<_>>()?;
    let t = Instant::now();
    let (mut accepted, mut refused) = (0u64, 0u64);
    for i in 0..a.n {
        if (i % 32 == 0 && until.exists()) || t.elapsed() > Duration::from_secs(600) {
            break;
        }
        if a.rate > 0 {
            let due = Duration::from_secs_f64(i as f64 / a.rate as f64);
            if let Some(wait) = due.checked_sub(t.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        let dir = dirs[i as usize % dirs.len()];
        let name = format!("rogue.{i:07}");
        match remote.mknod(dir, name.as_bytes(), libc::S_IFREG | 0o644, 0, &user()) {
            Ok(_) => accepted += 1,
            Err(e) if e.errno() == libc::EBUSY => refused += 1,
            Err(FsError::Io(m)) => bail!("the rogue: {m}"),
            Err(e) => bail!("the rogue's create {i}: {e}"),
        }
    }
    println!("{accepted} {refused}");
    Ok(())
}

/// One case: `k` clients, each `n` creates, with the rogue (paced at `rate` a second)
/// unless the case is `none`. The row's seconds are the slowest client's.
pub fn case(
    svc: &Service,
    case: &str,
    k: u32,
    n: u64,
    rate: u64,
    run: usize,
    local: &Path,
) -> Result<(Row, Option<Rogue>)> {
    let start = now_ms() + 1500 + 100 * u64::from(k);
    let dirs: Vec<String> = (0..k)
        .map(|i| format!("uc2-{case}-{k}-{run}-{i}"))
        .collect();
    let mut kids: Vec<Child> = dirs
        .iter()
        .map(|d| {
            spawn_client(svc, d, n, &format!("uc2-{case}"), start, local)
                .with_stdin()
                .spawn()
        })
        .collect::<Result<_>>()?;
    let until = local.join(format!("uc2-stop-{case}-{k}-{run}"));
    let _ = std::fs::remove_file(&until);
    let rogue = if case == "none" {
        None
    } else {
        // Bounded: never more attempts than every client's creates over again.
        let most = n * u64::from(k) * 4;
        let cmd = spawn_client(svc, &dirs.join(","), most, "rogue", start, local)
            .arg("--rate", rate.to_string())
            .arg("--until", &until)
            .niced();
        Some(cmd.spawn()?)
    };
    // Each client's `start end` line, read while it still holds its directory.
    let mut slowest = 0u64;
    let mut failed = None;
    for kid in &mut kids {
        match first_line(kid) {
            Ok((s, e)) => slowest = slowest.max(e.saturating_sub(s)),
            Err(e) => failed = Some(e),
        }
    }
    std::fs::write(&until, b"")?;
    let rogue = match rogue {
        Some(kid) => {
            let words = client_output(kid, "rogue")?;
            let [accepted, refused] = words[..] else {
                bail!("the rogue printed {words:?}");
            };
            Some(Rogue {
                case: case.to_string(),
                run,
                accepted,
                refused,
            })
        }
        None => None,
    };
    let _ = std::fs::remove_file(&until);
    for mut kid in kids {
        drop(kid.stdin.take());
        if let Err(e) = client_output(kid, &format!("use case 2 ({case})")) {
            failed = Some(e);
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let seconds = slowest as f64 / 1000.0;
    let row = Row {
        system: case.to_string(),
        workload: "use-case-2".into(),
        clients: k,
        run,
        creates: n,
        seconds,
        creates_per_s: n as f64 / seconds.max(1e-3),
    };
    Ok((row, rogue))
}

/// One client alone with use case 2's settings: the baseline of the slowdowns.
pub fn alone(svc: &Service, n: u64, run: usize, local: &Path) -> Result<Row> {
    let (mut row, _) = case(svc, "none", 1, n, 0, run, local)?;
    row.system = "alone".into();
    Ok(row)
}

/// Each case's slowdowns (its slowest client ÷ the same run's client alone).
fn slowdowns(rows: &[Row], case: &str) -> Vec<f64> {
    let of = |system: &str, run: usize| {
        rows.iter()
            .find(|r| r.workload == "use-case-2" && r.system == system && r.run == run)
            .map(|r| r.seconds)
    };
    rows.iter()
        .filter(|r| r.workload == "use-case-2" && r.system == case)
        .filter_map(|r| Some(r.seconds / of("alone", r.run)?.max(1e-3)))
        .collect()
}

/// The report's section for use case 2, and its goal.
pub fn report(
    md: &mut String,
    rows: &[Row],
    rogues: &[Rogue],
    judge: impl Fn(Option<bool>) -> &'static str,
) -> Result<()> {
    use std::fmt::Write as _;
    let Some(k) = rows
        .iter()
        .find(|r| r.workload == "use-case-2" && r.system != "alone")
        .map(|r| r.clients)
    else {
        return Ok(());
    };
    writeln!(
        md,
        "\n## Use case 2: a rogue client in every private directory (figure 5b)\n"
    )?;
    writeln!(
        md,
        "{k} clients, each creating in its own directory through RPCs with the paper's \
         settings (strong consistency, global durability); a rogue client creates in all \
         of them in turn, paced at the rate one client reaches alone and at the lowest \
         CPU priority (its own machine in the paper). Slowdown: the \
         slowest client's time ÷ one client's time alone in the same run (medians, \
         min–max).\n"
    )?;
    writeln!(
        md,
        "| case | slowest client, s | slowdown | rogue's creates accepted | refused (EBUSY: \
         by the service, or by the rogue's library remembering a refusal) |"
    )?;
    writeln!(md, "|---|---|---|---|---|")?;
    let alone = super::cell(rows, "use-case-2", "alone", 1);
    if let Some((t, lo, hi)) = alone {
        writeln!(
            md,
            "| one client alone | {t:.2} ({lo:.2}–{hi:.2}) | 1× | – | – |"
        )?;
    }
    let mut medians = std::collections::HashMap::new();
    for case in CASES {
        let Some((t, lo, hi)) = super::cell(rows, "use-case-2", case, k) else {
            continue;
        };
        let v = slowdowns(rows, case);
        let slow = (!v.is_empty()).then(|| crate::median(v));
        if let Some(s) = slow {
            medians.insert(case, s.0);
        }
        let counts = |f: fn(&Rogue) -> u64| {
            let v: Vec<f64> = rogues
                .iter()
                .filter(|r| r.case == case)
                .map(|r| f(r) as f64)
                .collect();
            if v.is_empty() {
                "–".to_string()
            } else {
                format!("{:.0}", crate::median(v).0)
            }
        };
        writeln!(
            md,
            "| {case} | {t:.2} ({lo:.2}–{hi:.2}) | {} | {} | {} |",
            slow.map_or("–".into(), |(m, lo, hi)| format!(
                "{m:.2}× ({lo:.2}–{hi:.2})"
            )),
            counts(|r| r.accepted),
            counts(|r| r.refused)
        )?;
    }
    let (block, none) = (medians.get("block"), medians.get("none"));
    let within = block
        .zip(none)
        .map(|(b, n)| (b / n.max(1e-9) - 1.0) * 100.0);
    writeln!(
        md,
        "\n- Block within 5% of no interference (slowdowns): {} — {}",
        within.map_or("–".into(), |w| format!("{w:+.1}%")),
        judge(within.map(|w| w <= 5.0))
    )?;
    writeln!(
        md,
        "\nThe paper (clients on their own machines): block 1.34×, no interference \
         1.42×, interference 1.67×.\n"
    )?;
    Ok(())
}

/// The `start end` line a client prints when its creates are done (it goes on
/// running until its standard input ends).
fn first_line(kid: &mut Child) -> Result<(u64, u64)> {
    use std::io::BufRead;
    let out = kid
        .stdout
        .as_mut()
        .ok_or_else(|| anyhow!("a client without its output"))?;
    let mut line = String::new();
    std::io::BufReader::new(out).read_line(&mut line)?;
    let mut words = line.split_whitespace().map(str::parse::<u64>);
    match (words.next(), words.next()) {
        (Some(Ok(s)), Some(Ok(e))) => Ok((s, e)),
        _ => bail!("a use case 2 client printed {line:?} (see its errors above)"),
    }
}
