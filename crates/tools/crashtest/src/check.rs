//! Checking one crash state: e2fsck, classification of what it reports, the journal
//! replays, and the persistence oracle.

use crate::workload::{state_of, tree_at, Expect, Invariant, Promise};
use quilt_block::MemDevice;
use quilt_ext2::{Ext2, Mode, MountOptions};

use quilt_vfs::FileSystem;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

/// How a problem e2fsck reports counts under a mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Verdict {
    /// The mode allows it (soft updates: leaks and overcounts).
    Allowed,
    /// The mode's guarantees are broken.
    Violation,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Problem {
    pub what: String,
    pub verdict: Verdict,
}

/// Runs e2fsck with `args` on a copy of `img`; returns its exit code, its output and,
/// unless `args` has `-n` (which opens the image read-only), the image afterwards.
pub fn e2fsck(img: &[u8], args: &[&str], tmp: &Path) -> std::io::Result<(i32, String, Vec<u8>)> {
    let f = tempfile::NamedTempFile::new_in(tmp)?;
    std::fs::write(f.path(), img)?;
    let o = Command::new("e2fsck").args(args).arg(f.path()).output()?;
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    // A read-only check changes nothing: reading the copy back would cost a full image read.
    let read_only = args
        .iter()
        .any(|a| a.starts_with('-') && !a.starts_with("--") && a.contains('n'));
    let after = if read_only {
        Vec::new()
    } else {
        std::fs::read(f.path())?
    };
    Ok((o.status.code().unwrap_or(-1), text, after))
}

/// The problems in an `e2fsck -fn` report (a question e2fsck asks on the problem's own
/// line stays part of it; a line that is only a question is skipped), each judged for
/// soft updates: what Featherstitch's
/// `filter_fsck` accepts (unattached or unconnected inodes, directory and free counts,
/// bitmap differences that only free (`-`), link counts too high, `..` of an orphaned
/// directory) plus `i_blocks` too high (a block count not yet lowered when the block was
/// freed, another overcount); everything else is a violation.
pub fn classify(report: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    for line in report.lines() {
        let l = line.trim();
        if l.is_empty()
            || l.starts_with("e2fsck ")
            || l.starts_with("Pass ")
            || l.contains(" files (")
            || l.starts_with("Fix? ")
            || l.starts_with("Clear? ")
            || l.starts_with("Connect to /lost+found? ")
            || l.starts_with("Salvage? ")
            || l.starts_with("Relocate? ")
            || l.contains("***** FILE SYSTEM WAS MODIFIED *****")
            || l.contains("********** WARNING: Filesystem still has errors **********")
            || l.starts_with("Group descriptor 0 checksum")
        {
            continue;
        }
        let verdict = if allowed(l) {
            Verdict::Allowed
        } else {
            Verdict::Violation
        };
        out.push(Problem {
            what: l.to_string(),
            verdict,
        });
    }
    out
}

fn numbers(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .filter_map(|t| t.parse().ok())
        .collect()
}

fn allowed(l: &str) -> bool {
    if l.starts_with("Unattached inode")
        || l.starts_with("Unattached zero-length inode")
        || l.starts_with("Unconnected directory inode")
        || l.starts_with("Directories count wrong")
        || l.starts_with("Free blocks count wrong")
        || l.starts_with("Free inodes count wrong")
        || (l.starts_with("'..' in") && l.contains("<The NULL inode>"))
        // An inode with no links whose free had not reached the disk: a file unlinked
        // while still held (open, or referenced by a FUSE mount), which e2fsck frees,
        // as after kernel ext2 crashes with such a file. A name left pointing at it is
        // reported apart (as a deleted/unused inode) and stays a violation.
        || (l.starts_with("Deleted inode ") && l.contains(" has zero dtime"))
    {
        return true;
    }
    for head in ["Block bitmap differences:", "Inode bitmap differences:"] {
        if let Some(rest) = l.strip_prefix(head) {
            // Only "-" entries: marked in use but free, i.e. leaks.
            return rest
                .split_whitespace()
                .all(|t| t.starts_with('-') || t == "Fix?" || t == "no");
        }
    }
    if l.starts_with("Inode ") && l.contains(" ref count is ") {
        let n = numbers(l.split(" ref count is ").nth(1).unwrap_or(""));
        return n.len() >= 2 && n[0] > n[1];
    }
    if l.starts_with("Inode ") && l.contains("i_blocks is ") {
        let n = numbers(l.split("i_blocks is ").nth(1).unwrap_or(""));
        return n.len() >= 2 && n[0] > n[1];
    }
    false
}

fn mount(img: &[u8], mode: Mode, read_only: bool) -> Result<(Arc<MemDevice>, Ext2), String> {
    let dev = Arc::new(MemDevice::from_bytes(4096, img).map_err(|e| e.to_string())?);
    let fs = quilt_stack::ext2(
        dev.clone(),
        quilt_stack::Ext2Spec::mount(MountOptions {
            mode,
            read_only,
            ..Default::default()
        }),
    )
    .map_err(|e| e.to_string())?;
    Ok((dev, fs))
}

/// Whether the image's journal (in inode 8) may hold skip records to replay: the
/// incompatible feature set and the log not empty.
fn skip_records_pending(img: &[u8]) -> bool {
    let Ok(dev) = MemDevice::from_bytes(4096, img) else {
        return false;
    };
    let Some(sb) = img
        .get(1024..2048)
        .and_then(|b| quilt_ext2::format::Superblock::decode(b).ok())
    else {
        return false;
    };
    let Ok(map) = quilt_ext2::journal::journal_map(&dev, &sb) else {
        return false;
    };
    let mut b = vec![0u8; 4096];
    if map
        .device_block(0)
        .ok()
        .and_then(|at| quilt_block::BlockDevice::read(&dev, at, &mut b).ok())
        .is_none()
    {
        return false;
    }
    quilt_journal::JournalSuper::decode(&b, 4096, map.len())
        .is_ok_and(|j| j.start != 0 && quilt_journal::skip::is_skip(&j))
}

/// Everything a checker reports about one state.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Outcome {
    pub problems: Vec<Problem>,
    pub violations: usize,
    /// Promises checked in this state.
    pub promises_checked: usize,
    /// What e2fsck -fn said (of the state, or after our replay in the journal modes).
    #[serde(skip)]
    pub fsck: String,
}

/// Checks the state `img` of a run in `mode`. `promises`: the fsync promises that stand
/// at the cut (made before it, not undone by a later operation); `invariants`: what the
/// run's guarantees say holds at any cut.
pub fn check_state(
    img: &[u8],
    mode: Mode,
    promises: &[&Promise],
    invariants: &[&Invariant],
    tmp: &Path,
) -> Outcome {
    let mut out = Outcome::default();
    let violation = |what: String, out: &mut Outcome| {
        out.problems.push(Problem {
            what,
            verdict: Verdict::Violation,
        });
    };
    let recovered: Vec<u8> = if mode.is_journal() {
        // Our replay and e2fsck's must both be clean and agree.
        let ours = match mount(img, Mode::Async, false).and_then(|(dev, fs)| {
            fs.unmount().map_err(|e| e.to_string())?;
            drop(fs);
            Ok(dev.to_vec())
        }) {
            Ok(b) => b,
            Err(e) => {
                violation(format!("our replay failed: {e}"), &mut out);
                out.violations = out.problems.len();
                return out;
            }
        };
        match e2fsck(&ours, &["-fn"], tmp) {
            Ok((0, _, _)) => {}
            Ok((_, text, _)) => {
                out.fsck = text.clone();
                for p in classify(&text) {
                    violation(format!("after our replay: {}", p.what), &mut out);
                }
            }
            Err(e) => violation(format!("running e2fsck: {e}"), &mut out),
        }
        if skip_records_pending(img) {
            // A journal with skip records: e2fsck must refuse it, not misread it.
            match e2fsck(img, &["-fn"], tmp) {
                Ok((rc, text, _)) if rc >= 8 && text.contains("unknown incompatible feature") => {}
                Ok((rc, text, _)) => violation(
                    format!(
                        "e2fsck did not refuse a journal with skip records (exit {rc}): {}",
                        text.lines().next().unwrap_or("")
                    ),
                    &mut out,
                ),
                Err(e) => violation(format!("running e2fsck: {e}"), &mut out),
            }
        } else {
            match e2fsck(img, &["-fy"], tmp) {
                Ok((rc, _, theirs)) if rc <= 1 => {
                    // e2fsck's result need not be checked apart: it must equal ours, which
                    // e2fsck -fn found clean above.
                    if let (Ok((_, a)), Ok((_, b))) = (
                        mount(&ours, Mode::Async, true),
                        mount(&theirs, Mode::Async, true),
                    ) {
                        if let Some(d) = first_difference(&a, &b) {
                            violation(format!("our replay and e2fsck's differ at {d}"), &mut out);
                        }
                    } else {
                        violation("a replayed image does not mount".into(), &mut out);
                    }
                }
                Ok((rc, text, _)) => violation(
                    format!(
                        "e2fsck -fy exit {rc}: {}",
                        text.lines().last().unwrap_or("")
                    ),
                    &mut out,
                ),
                Err(e) => violation(format!("running e2fsck: {e}"), &mut out),
            }
        }
        ours
    } else {
        match e2fsck(img, &["-fn"], tmp) {
            Ok((0, _, _)) => {}
            Ok((_, text, _)) => {
                out.fsck = text.clone();
                for mut p in classify(&text) {
                    if mode != Mode::SoftUpdates {
                        // Async promises nothing: everything it leaves counts.
                        p.verdict = Verdict::Violation;
                    }
                    out.problems.push(p);
                }
            }
            Err(e) => violation(format!("running e2fsck: {e}"), &mut out),
        }
        img.to_vec()
    };
    // Persistence: every promise nothing later touched must hold.
    match mount(&recovered, Mode::Async, true) {
        Ok((_, fs)) => check_promises(
            &fs,
            promises,
            invariants,
            mode != Mode::SoftUpdates,
            &mut out,
        ),
        Err(e) => violation(format!("the crash state does not mount: {e}"), &mut out),
    }
    out.violations = out
        .problems
        .iter()
        .filter(|p| p.verdict == Verdict::Violation)
        .count();
    out
}

/// Every promise and invariant against the recovered file system `fs`.
fn check_promises(
    fs: &dyn FileSystem,
    promises: &[&Promise],
    invariants: &[&Invariant],
    strict: bool,
    out: &mut Outcome,
) {
    let violation = |what: String, out: &mut Outcome| {
        out.problems.push(Problem {
            what,
            verdict: Verdict::Violation,
        });
    };
    for p in promises {
        out.promises_checked += 1;
        let got = resolve(fs, &p.path).and_then(|i| state_of(fs, i));
        let ok = match (&p.expect, &got) {
            (Expect::File(want), Some(Expect::File(g))) => want == g,
            (Expect::Dir(want), Some(Expect::Dir(g))) => want == g,
            _ => false,
        };
        if !ok {
            let what = match (&p.expect, &got) {
                (_, None) => "is missing".to_string(),
                (Expect::File(w), Some(Expect::File(g))) => {
                    format!("has {} bytes, not the {} fsynced", g.len(), w.len())
                }
                (Expect::Dir(w), Some(Expect::Dir(g))) => format!(
                    "lists {:?}, not the fsynced {:?}",
                    g.iter().take(6).collect::<Vec<_>>(),
                    w.iter().take(6).collect::<Vec<_>>()
                ),
                _ => "changed kind".to_string(),
            };
            violation(format!("/{} ({}) {what}", p.path, p.mark), out);
        }
    }
    for inv in invariants {
        out.promises_checked += 1;
        if let Some(what) = broken(fs, inv, strict) {
            violation(what, out);
        }
    }
}

/// Checks a betrfs crash state: it must mount (log replay, then what recovery
/// finishes), `quiltfs fsck` must find nothing, and every promise and invariant must
/// hold. betrfs has one mode: every operation is atomic and the log is one sequence, so
/// nothing is merely "allowed".
pub fn check_betrfs_state(img: &[u8], promises: &[&Promise], invariants: &[&Invariant]) -> Outcome {
    let mut out = Outcome::default();
    let violation = |what: String, out: &mut Outcome| {
        out.problems.push(Problem {
            what,
            verdict: Verdict::Violation,
        });
    };
    let dev = match MemDevice::from_bytes(4096, img) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            violation(format!("building the state: {e}"), &mut out);
            out.violations = 1;
            return out;
        }
    };
    match quilt_betrfs::fsck::fsck(dev.clone(), false) {
        Ok(r) => {
            for p in r.problems {
                violation(format!("fsck: {p}"), &mut out);
            }
        }
        Err(e) => violation(format!("fsck cannot mount the state: {e}"), &mut out),
    }
    let opts = quilt_betrfs::MountOptions {
        commit_interval: None,
        ..Default::default()
    };
    match quilt_stack::betrfs(dev, opts) {
        Ok(fs) => check_promises(&fs, promises, invariants, true, &mut out),
        Err(e) => violation(format!("the crash state does not mount: {e}"), &mut out),
    }
    out.violations = out.problems.len();
    out
}

/// How `inv` is broken in `fs`, if it is.
/// `strict`: a rename may never leave two names (betrfs, the journal modes).
fn broken(fs: &dyn FileSystem, inv: &Invariant, strict: bool) -> Option<String> {
    match inv {
        Invariant::Moved {
            stem,
            src_dir,
            dst_dir,
            content,
        } => {
            let names = |dir: &str| -> Vec<(String, u64)> {
                let mut v = Vec::new();
                if let Some(d) = resolve(fs, dir) {
                    let _ = fs.readdir(d, 0, &mut |e| {
                        if e.name.starts_with(stem.as_bytes()) {
                            v.push((String::from_utf8_lossy(&e.name).into_owned(), e.ino));
                        }
                        true
                    });
                }
                v
            };
            let mut complete = false;
            for (name, ino) in names(dst_dir) {
                match state_of(fs, ino) {
                    Some(Expect::File(got)) if got == *content => complete = true,
                    Some(Expect::File(got)) => {
                        return Some(format!(
                        "/{dst_dir}/{name} has {} bytes, not the {} of the message copied there",
                        got.len(),
                        content.len()
                    ))
                    }
                    _ => return Some(format!("/{dst_dir}/{name} is not a readable file")),
                }
            }
            if !complete && names(src_dir).is_empty() {
                return Some(format!(
                    "message {stem}* is gone from /{src_dir} and missing from /{dst_dir}"
                ));
            }
            None
        }
        Invariant::OneOf { names, tree } => {
            let holding: Vec<&String> = names
                .iter()
                .filter(|n| tree_at(fs, n).as_ref() == Some(tree))
                .collect();
            match holding.len() {
                1 => None,
                0 => Some(format!(
                    "the tree of {} entries renamed along {names:?} is under none of them, whole",
                    tree.len()
                )),
                _ if !strict => None,
                _ => Some(format!(
                    "the tree of {} entries is under {holding:?} at once",
                    tree.len()
                )),
            }
        }
        Invariant::Cloned {
            src,
            dst,
            src_made,
            tree,
            ..
        } => {
            let there = resolve(fs, dst).is_some();
            if (there || !src_made) && tree_at(fs, src).as_ref() != Some(tree) {
                return Some(format!("/{src}, the original of a clone, is not whole"));
            }
            match (there, tree_at(fs, dst)) {
                (false, _) => None,
                (true, Some(t)) if t == *tree => None,
                _ => Some(format!("/{dst}, a clone of /{src}, is there but not whole")),
            }
        }
        Invariant::Unchanged { path, tree, .. } => (tree_at(fs, path).as_ref() != Some(tree))
            .then(|| format!("/{path} changed (it is a clone's original or a clone)")),
    }
}

fn resolve(fs: &dyn FileSystem, path: &str) -> Option<u64> {
    crate::workload::resolve(fs, path).ok()
}

/// The first path at which two trees differ (kind, size, links, contents, names).
fn first_difference(a: &Ext2, b: &Ext2) -> Option<String> {
    let mut stack = vec![String::new()];
    while let Some(p) = stack.pop() {
        let (ia, ib) = (resolve(a, &p), resolve(b, &p));
        let (sa, sb) = (
            ia.and_then(|i| state_of(a, i)),
            ib.and_then(|i| state_of(b, i)),
        );
        if sa != sb {
            return Some(format!("/{p}"));
        }
        let (Some(ia), Some(ib)) = (ia, ib) else {
            continue;
        };
        let (aa, ab) = (a.getattr(ia).ok(), b.getattr(ib).ok());
        if aa.map(|x| (x.nlink, x.perm)) != ab.map(|x| (x.nlink, x.perm)) {
            return Some(format!("/{p} (attributes)"));
        }
        if let Some(Expect::Dir(names)) = sa {
            for n in names {
                stack.push(if p.is_empty() { n } else { format!("{p}/{n}") });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soft_updates_allows_leaks_and_overcounts_only() {
        let report = "e2fsck 1.47.0 (5-Feb-2023)\n\
            Pass 1: Checking inodes, blocks, and sizes\n\
            Inode 12, i_blocks is 16, should be 8.  Fix? no\n\
            Pass 4: Checking reference counts\n\
            Inode 13 ref count is 2, should be 1.  Fix? no\n\
            Unattached inode 14\n\
            Deleted inode 15 has zero dtime.  Fix? no\n\
            Pass 5: Checking group summary information\n\
            Block bitmap differences:  -(100--103) -200\n\
            Fix? no\n\
            Free blocks count wrong (10, counted=14).\n\
            img: 14/64 files (0.0% non-contiguous), 30/256 blocks\n";
        let p = classify(report);
        assert_eq!(p.len(), 6, "{p:?}");
        assert!(p.iter().all(|x| x.verdict == Verdict::Allowed), "{p:?}");
        let bad = "Block bitmap differences:  +150 -160\n\
            Inode 13 ref count is 1, should be 2.  Fix? no\n\
            Entry 'foo' in / (2) has deleted/unused inode 15.  Clear? no\n\
            Inode 12, i_blocks is 8, should be 16.  Fix? no\n";
        let p = classify(bad);
        assert_eq!(p.len(), 4);
        assert!(p.iter().all(|x| x.verdict == Verdict::Violation), "{p:?}");
    }
}
