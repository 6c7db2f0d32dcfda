//! The command line as a user meets it: the version names the build, completions and
//! progress come out in forms that other programs read, bad flags are refused.

use std::process::Command;

fn quiltfs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_quiltfs"))
}

#[test]
fn version_names_the_commit() {
    let out = quiltfs().arg("--version").output().expect("runs");
    let v = String::from_utf8(out.stdout).expect("utf-8");
    let want = format!("quiltfs {} (commit ", env!("CARGO_PKG_VERSION"));
    assert!(v.starts_with(&want), "{v}");
    let commit = v[want.len()..].split([',', ')']).next().unwrap_or("");
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{v}"
    );
}

#[test]
fn completions_for_each_shell() {
    for (shell, marker) in [
        ("bash", "complete -F _quiltfs"),
        ("zsh", "#compdef quiltfs"),
        ("fish", "complete -c quiltfs"),
    ] {
        let out = quiltfs()
            .args(["completions", shell])
            .output()
            .expect("runs");
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8(out.stdout).expect("utf-8");
        assert!(text.contains(marker), "{shell}: no {marker:?}");
        assert!(
            text.contains("mount") && text.contains("replica"),
            "{shell}: subcommands missing"
        );
    }
    let out = quiltfs()
        .args(["completions", "tcsh"])
        .output()
        .expect("runs");
    assert!(!out.status.success(), "an unknown shell is refused");
}

/// Off a terminal, progress is plain lines (no control characters) that count up to the
/// total; the first line may come at once with QUILTFS_PROGRESS_SECS=0.
#[test]
fn progress_off_a_terminal_is_plain_lines() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let img = dir.path().join("p.img");
    let out = quiltfs()
        .args(["mkfs", "--size", "1G"])
        .arg(&img)
        .env("QUILTFS_PROGRESS_SECS", "0")
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(!err.contains('\u{1b}'), "control characters in {err:?}");
    let counts: Vec<(u64, u64)> = err
        .lines()
        .filter_map(|l| l.strip_prefix("mkfs: "))
        .filter_map(|l| {
            let (done, rest) = l.split_once('/')?;
            let total = rest.split(' ').next()?;
            Some((done.parse().ok()?, total.parse().ok()?))
        })
        .collect();
    assert!(counts.len() >= 2, "{err}");
    assert!(counts.windows(2).all(|w| w[0].0 <= w[1].0), "{err}");
    let (done, total) = *counts.last().expect("a line");
    assert_eq!(done, total, "{err}");
    // Without the variable: one line per 10 s, so none for a mkfs this small.
    let img2 = dir.path().join("q.img");
    let out = quiltfs()
        .args(["mkfs", "--size", "1G"])
        .arg(&img2)
        .output()
        .expect("runs");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("mkfs: "),
        "a line too soon"
    );
}

#[test]
fn a_bad_log_filter_is_named_and_the_command_still_runs() {
    let out = quiltfs()
        .args(["--log", "quilt=[", "completions", "bash"])
        .output()
        .expect("runs");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("log filter") && err.contains("ignored"),
        "{err}"
    );
    let out = quiltfs()
        .args(["--log-target", "syslog", "completions", "bash"])
        .output()
        .expect("runs");
    assert!(!out.status.success(), "an unknown target is refused");
}
