//! Bugs the explorer found, each checked again over every crash state of the workload
//! that showed it. Needs e2fsck (skipped without it unless QUILT_REQUIRE_E2FSCK=1).

use quilt_crashtest::{run, Config};
use quilt_ext2::{JournalPlacement, Mode};

fn e2fsck_available() -> bool {
    let ok = std::process::Command::new("e2fsck")
        .arg("-V")
        .output()
        .is_ok();
    if !ok {
        assert!(
            std::env::var("QUILT_REQUIRE_E2FSCK").map_or(true, |v| v != "1"),
            "QUILT_REQUIRE_E2FSCK=1 but e2fsck is missing"
        );
        eprintln!("SKIPPED: e2fsck is not installed");
    }
    ok
}

fn explore(mode: Mode, workload: &str, states: usize) -> quilt_crashtest::Report {
    explore_seed(mode, workload, states, 7)
}

fn explore_seed(mode: Mode, workload: &str, states: usize, seed: u64) -> quilt_crashtest::Report {
    explore_placed(mode, workload, states, seed, JournalPlacement::Ring)
}

fn explore_placed(
    mode: Mode,
    workload: &str,
    states: usize,
    seed: u64,
    placement: JournalPlacement,
) -> quilt_crashtest::Report {
    let cfg = Config {
        mode,
        betrfs: false,
        lying: false,
        workload: workload.into(),
        states,
        seed,
        keep_failures: None,
        placement,
        more_seeds: false,
    };
    run(&cfg, |_, _, _| {}).expect("explorer runs")
}

/// rmdir decremented the parent's link count once the entry was gone, but e2fsck still
/// counts the removed directory's ".." until its inode is cleared: a crash between the
/// two left the parent's count too low (e.g. "Inode 2 ref count is 4, should be 5").
#[test]
fn rmdir_counts_the_parent_down_only_after_the_child_is_cleared() {
    if !e2fsck_available() {
        return;
    }
    let r = explore(Mode::SoftUpdates, "rmrf", 100_000);
    // Distinct crash images (cuts that leave the same image count once).
    assert!(r.states_checked >= 30, "{}", r.text());
    assert_eq!(r.with_violations, 0, "{}", r.text());
    assert!(
        r.allowed_only > 0,
        "soft updates should leak in some states"
    );
}

/// An fsynced file in a directory created since was not reachable after a crash:
/// fsync made the file and its entry durable, not the new directory's own name.
#[test]
fn fsynced_files_in_new_directories_are_reachable() {
    if !e2fsck_available() {
        return;
    }
    let r = explore(Mode::SoftUpdates, "untar", 400);
    assert!(r.promises_checked > 100, "{}", r.text());
    assert_eq!(r.with_violations, 0, "{}", r.text());
}

/// Removing an entry by lengthening the previous record wrote only that length, computed
/// from the removed record's length as a pending split had set it. When the split was
/// rolled back at write-back, the new length exposed the stale bytes of an entry removed
/// earlier, whose inode was already freed ("Entry 'f3' ... has deleted/unused inode 16"
/// at seed 11). The removal now covers both lengths, so it waits for the split.
#[test]
fn an_entry_removal_waits_for_the_split_it_measured() {
    if !e2fsck_available() {
        return;
    }
    let r = explore_seed(Mode::SoftUpdates, "postmark", 100_000, 11);
    assert!(r.states_checked >= 200, "{}", r.text());
    assert_eq!(r.with_violations, 0, "{}", r.text());
}

/// The explorer is not blind: async, which keeps no order, must show violations.
#[test]
fn async_shows_violations() {
    if !e2fsck_available() {
        return;
    }
    let r = explore(Mode::Async, "untar", 200);
    assert!(r.with_violations > 0, "{}", r.text());
}

/// The mail move with patchgroups (what the LD_PRELOAD library makes of Dovecot's
/// fsyncs) never loses a message in any crash state, in every mode with ordering; the
/// same move with nothing ordered does, so the check can see a lost message.
#[test]
fn mail_move_with_patchgroups_never_loses_a_message() {
    if !e2fsck_available() {
        return;
    }
    let states = if std::env::var("CI").is_ok_and(|v| v == "true") {
        150
    } else {
        100_000
    };
    for mode in [Mode::SoftUpdates, Mode::MetaJournal, Mode::FullJournal] {
        let r = explore_seed(mode, "mail", states, 1);
        assert!(r.states_checked >= 10, "{}", r.text());
        assert_eq!(r.with_violations, 0, "{mode}: {}", r.text());
    }
    let r = explore_seed(Mode::SoftUpdates, "mail-unordered", 100_000, 1);
    assert!(
        r.problem_kinds
            .keys()
            .any(|k| k.contains("is gone from /src/cur and missing from /dst/cur")),
        "the unordered move should lose messages in some crash state: {}",
        r.text()
    );
}

/// The log-skipping journal (records on a disk model in virtual time, so they land all
/// over the area, torn ones included in the states): every state recovers to exactly
/// the committed transactions in order (the journal model), passes e2fsck after our
/// replay, keeps its fsyncs; e2fsck refuses the unreplayed journal rather than misread
/// it. The full run is `quiltfs crashtest --journal-placement skip`.
#[test]
fn skip_records_recover_exactly_the_committed_transactions() {
    if !e2fsck_available() {
        return;
    }
    for mode in [Mode::MetaJournal, Mode::FullJournal] {
        let r = explore_placed(mode, "untar", 60, 1, JournalPlacement::Skip);
        assert!(r.states_checked >= 40, "{}", r.text());
        assert!(r.promises_checked > 20, "{}", r.text());
        assert_eq!(r.with_violations, 0, "{mode}: {}", r.text());
    }
}
