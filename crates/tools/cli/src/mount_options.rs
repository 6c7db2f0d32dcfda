//! Every `-o` option of `quiltfs mount` (and of `mount -t fuse.quiltfs` and fstab
//! lines), as a table: the source of the quiltfs-mount-options(7) man page. A test
//! holds it and the parser in `mount.rs` to each other, both ways.

/// One option: how it is written, an example that parses, and what it does.
pub struct MountOption {
    pub syntax: &'static str,
    pub example: &'static str,
    pub doc: &'static str,
}

const fn o(syntax: &'static str, example: &'static str, doc: &'static str) -> MountOption {
    MountOption {
        syntax,
        example,
        doc,
    }
}

/// Groups of options, each with a heading, in the page's order.
pub const GROUPS: &[(&str, &[MountOption])] = &[
    (
        "Access",
        &[
            o("ro", "ro", "Read-only: the mount refuses every change."),
            o("rw", "rw", "Read-write (the default)."),
            o("allow_other", "allow_other", "Every user may use the mount, under its permission bits and ACLs: the default for mounts made by root, as for a kernel file system."),
            o("noallow_other", "noallow_other", "Only the user who mounted may use it (FUSE's own default)."),
            o("acl", "acl", "Enforce POSIX ACLs and inherit default ACLs (the default)."),
            o("noacl", "noacl", "Ignore ACLs: permission bits alone decide."),
            o("nodev, nosuid, noexec", "nosuid", "Passed to the kernel, as for any mount."),
        ],
    ),
    (
        "Consistency and durability",
        &[
            o("mode=MODE", "mode=meta-journal", "async, soft-updates (the default), meta-journal or full-journal; the journal modes need an image made with `quiltfs mkfs --journal`. The same as --mode."),
            o("unsafe", "unsafe", "Skip device flushes: write order is kept against crashes of the server, not of the machine. The same as --unsafe."),
            o("errors=remount-ro|continue", "errors=continue", "After damage is found: mark it in the superblock and refuse further changes (remount-ro, the default), or go on (continue)."),
            o("flusher_ms=N", "flusher_ms=500", "Write back in the background every N milliseconds (1000 by default); 0 writes back only when memory, fsync, sync or unmount ask."),
            o("journal=ring|skip|null", "journal=skip", "Where journal commits go: the JBD2 ring, log skipping (range writes wherever the disk head is), or nowhere (for measuring only). Default: what mkfs made the journal for."),
            o("journal_dev=PATH", "journal_dev=/srv/journal.img", "The external journal of an image made with `quiltfs mkfs --journal-dev`."),
        ],
    ),
    (
        "Caching and requests",
        &[
            o("cache_mib=N", "cache_mib=256", "The server's block cache, MiB (at least 4). The same as --cache-mib."),
            o("wbcache", "wbcache", "The kernel's writeback cache: fewer, larger writes. The kernel may hold at most dirty_mib MiB unwritten and the mount keeps that much room for it: when space runs low, files opened for writing write through and writes through the cache fail with ENOSPC in write(2), so nothing acknowledged is lost."),
            o("nowbcache", "nowbcache", "Every write(2) reaches the server before it returns (the default)."),
            o("dirty_mib=N", "dirty_mib=32", "With wbcache: the most the kernel may hold unwritten for this mount, MiB (64 by default, at most a sixteenth of the file system)."),
            o("threads=N", "threads=4", "Threads reading /dev/fuse, when requests do not come over io_uring."),
            o("uring", "uring", "Requests over io_uring, each served on its caller's CPU, where the kernel offers it (/sys/module/fuse/parameters/enable_uring is Y): the default."),
            o("nouring", "nouring", "Always /dev/fuse."),
            o("ring_threads=N", "ring_threads=1", "Ring workers per CPU (2 by default, at least 1)."),
            o("handoff=auto|always|never, handoff, nohandoff", "handoff=never", "Whether ring workers hand their CPU to the caller with each answer: auto (the default) does while callers ping-pong between CPUs and some CPU is idle; handoff and nohandoff are always and never."),
        ],
    ),
    (
        "Disk models and measurement",
        &[
            o("model=7200|none", "model=7200", "The image behind a model of a 7200 RPM disk, its write cache on (real time)."),
            o("journal_model=7200|none", "journal_model=7200", "The external journal behind a model of a 7200 RPM disk, its write cache off."),
            o("model_nohostsync", "model_nohostsync", "The models' flushes stop at the model: the files under them are not flushed on the host. For benchmarks only: the files then survive a crash of quiltfs but not one of the host."),
            o("nohard", "nohard", "The patch engine's hard patches off (to compare the optimization)."),
            o("nomerge", "nomerge", "The patch engine's overlap merging off (to compare the optimization)."),
            o("metrics=HOST:PORT", "metrics=127.0.0.1:9430", "Serve the counters that `quiltfs stats` shows (the module's, the patch layer's, the device's and the FUSE requests by type) for Prometheus at http://HOST:PORT/metrics, from the server."),
        ],
    ),
    (
        "Ignored (fstab and mount(8) bookkeeping)",
        &[o(
            "defaults, auto, noauto, user, nouser, users, _netdev, nofail, dev, suid, exec, relatime, noatime, atime",
            "defaults",
            "Accepted and ignored, so that fstab lines read as for any file system.",
        )],
    ),
];

/// The man page, in man(7) roff.
pub fn man_page(version: &str) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        ".TH QUILTFS-MOUNT-OPTIONS 7 \"\" \"quiltfs {version}\" \"quiltfs\"\n"
    ));
    s.push_str(".SH NAME\nquiltfs-mount-options \\- options of quiltfs mounts\n");
    s.push_str(".SH SYNOPSIS\n.B quiltfs mount\n.I IMAGE MOUNTPOINT\n.B \\-o\n.IR OPTION [, OPTION ...]\n.br\n.B mount \\-t fuse.quiltfs\n.I IMAGE MOUNTPOINT\n.B \\-o\n.IR OPTION [, OPTION ...]\n");
    s.push_str(".SH DESCRIPTION\nOptions are given as a comma-separated list, on the command line or in the fourth field of an\n.BR fstab (5)\nline such as\n.PP\n.RS\n.nf\n/srv/disk.img  /mnt/q  fuse.quiltfs  mode=soft\\-updates,allow_other  0 0\n.fi\n.RE\n.PP\nAn unknown option is refused with an error; nothing is mounted.\n");
    for (heading, opts) in GROUPS {
        s.push_str(&format!(".SS {}\n", roff(heading)));
        for opt in *opts {
            s.push_str(&format!(
                ".TP\n.B {}\n{}\n",
                roff(opt.syntax),
                roff(opt.doc)
            ));
            if opt.syntax.contains('=') {
                s.push_str(&format!("For example:\n.BR {} .\n", roff(opt.example)));
            }
        }
    }
    s.push_str(".SH EXAMPLES\n.nf\nquiltfs mount disk.img /mnt/q \\-o mode=full\\-journal,wbcache\nmount \\-t fuse.quiltfs disk.img /mnt/q \\-o mode=async,cache_mib=512\n.fi\n");
    s.push_str(".SH SEE ALSO\n.BR quiltfs (1),\n.BR quiltfs\\-mount (1),\n.BR quiltfs\\-formats (5),\n.BR fstab (5),\n.BR mount (8)\n");
    s
}

/// Text made safe for roff: backslashes and hyphens escaped, no line starting with a
/// control character.
pub fn roff(t: &str) -> String {
    let t = t.replace('\\', "\\e").replace('-', "\\-");
    match t.chars().next() {
        Some('.' | '\'') => format!("\\&{t}"),
        _ => t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn args(option: &str) -> crate::mount::MountArgs {
        crate::mount::MountArgs {
            image: "disk.img".into(),
            mountpoint: "/mnt".into(),
            mode: quilt_ext2::Mode::SoftUpdates,
            foreground: false,
            r#unsafe: false,
            cache_mib: crate::image::DEFAULT_CACHE_MIB,
            options: vec![option.to_string()],
            notify_ready: false,
        }
    }

    #[test]
    fn every_documented_example_parses() {
        for (_, opts) in GROUPS {
            for opt in *opts {
                if let Err(e) = crate::mount::parse(&args(opt.example)) {
                    panic!("{} (documented as {}): {e}", opt.example, opt.syntax);
                }
            }
        }
        assert!(crate::mount::parse(&args("no_such_option")).is_err());
    }

    /// Every word the parser matches (option names and their fixed values) is in the
    /// table: an option added to the parser and not to the page fails here.
    #[test]
    fn every_parsed_option_is_documented() {
        let src = include_str!("mount.rs");
        let start = src.find("match (k, v) {").expect("the parser's match");
        let end = start
            + src[start..]
                .find("_ => bail!(\"unknown mount option")
                .expect("its end");
        let mut parsed = BTreeSet::new();
        for (i, lit) in src[start..end].split('"').enumerate() {
            // Odd pieces are inside quotes; option words are lowercase identifiers.
            if i % 2 == 1
                && !lit.is_empty()
                && lit
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit())
            {
                parsed.insert(lit.to_string());
            }
        }
        assert!(
            parsed.contains("wbcache") && parsed.contains("journal_dev"),
            "{parsed:?}"
        );
        let documented: BTreeSet<String> = GROUPS
            .iter()
            .flat_map(|(_, opts)| opts.iter())
            .flat_map(|o| {
                o.syntax
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            })
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect();
        let missing: Vec<_> = parsed.difference(&documented).collect();
        assert!(
            missing.is_empty(),
            "parsed but not in quiltfs-mount-options(7): {missing:?}"
        );
    }

    #[test]
    fn the_page_is_roff_without_stray_control_lines() {
        let page = man_page("0.0.0");
        assert!(page.starts_with(".TH QUILTFS-MOUNT-OPTIONS 7"));
        for (_, opts) in GROUPS {
            for opt in *opts {
                assert!(page.contains(&roff(opt.syntax)), "{}", opt.syntax);
            }
        }
        assert_eq!(roff(".x-y\\z"), "\\&.x\\-y\\ez");
    }
}
