//! The systems of the Featherstitch suite: quiltfs's ext2 module in every mode (and the
//! optimization table's variants), kernel ext2, ext3 and ext4, fuse2fs, and the FUSE
//! floor.

pub use crate::systems::{
    log_tail, Disk, Kind, Mounted, QuiltFs, System, BINDFS, CACHE_MIB, MKFS_EXT2, MKFS_EXT3,
    MKFS_EXT4, PASSTHROUGH, PASSTHROUGH_KERNEL,
};
use anyhow::{Context, Result};

const fn quilt(
    name: &'static str,
    what: &'static str,
    mode: &'static str,
    unsafe_: bool,
) -> System {
    System {
        name,
        what,
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode,
            unsafe_,
            options: "",
        },
        safe: !unsafe_,
        opt: None,
    }
}

const fn opt(name: &'static str, options: &'static str, opt: &'static str) -> System {
    System {
        name,
        what: "quiltfs soft updates, for the optimization table",
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode: "soft-updates",
            unsafe_: false,
            options,
        },
        safe: true,
        opt: Some(opt),
    }
}

pub const SYSTEMS: &[System] = &[
    System {
        opt: Some("both"),
        ..quilt("quilt-su", "quiltfs soft updates", "soft-updates", false)
    },
    quilt(
        "quilt-meta",
        "quiltfs metadata journal",
        "meta-journal",
        false,
    ),
    quilt("quilt-full", "quiltfs full journal", "full-journal", false),
    quilt("quilt-async", "quiltfs asynchronous", "async", false),
    // The kernel's writeback cache instead of write-through writes: what exact write(2)
    // errors cost (with it, a full disk shows at fsync or close while space is ample).
    System {
        name: "quilt-su-wbcache",
        what: "quiltfs soft updates, kernel writeback cache",
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode: "soft-updates",
            unsafe_: false,
            options: "wbcache",
        },
        safe: true,
        opt: None,
    },
    // The same over /dev/fuse instead of io_uring: what the ring transport buys.
    System {
        name: "quilt-su-dev",
        what: "quiltfs soft updates over /dev/fuse (no io_uring)",
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode: "soft-updates",
            unsafe_: false,
            options: "nouring",
        },
        safe: true,
        opt: None,
    },
    // The ring handing the CPU to the caller at every answer, and never (fusewire's
    // handoff.rs; the default hands off only while callers ping-pong between CPUs).
    System {
        name: "quilt-su-handoff",
        what: "quiltfs soft updates over io_uring, CPU handoff always",
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode: "soft-updates",
            unsafe_: false,
            options: "handoff=always",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "quilt-su-nohandoff",
        what: "quiltfs soft updates over io_uring, CPU handoff never",
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode: "soft-updates",
            unsafe_: false,
            options: "handoff=never",
        },
        safe: true,
        opt: None,
    },
    quilt(
        "quilt-su-unsafe",
        "quiltfs soft updates, no flushes",
        "soft-updates",
        true,
    ),
    quilt(
        "quilt-meta-unsafe",
        "quiltfs metadata journal, no flushes",
        "meta-journal",
        true,
    ),
    quilt(
        "quilt-full-unsafe",
        "quiltfs full journal, no flushes",
        "full-journal",
        true,
    ),
    quilt(
        "quilt-async-unsafe",
        "quiltfs asynchronous, no flushes",
        "async",
        true,
    ),
    System {
        name: "ext2",
        what: "Linux ext2",
        kind: Kind::Kernel {
            mkfs: MKFS_EXT2,
            fstype: "ext2",
            options: "",
        },
        safe: false,
        opt: None,
    },
    System {
        name: "ext3-writeback",
        what: "Linux ext3 data=writeback",
        kind: Kind::Kernel {
            mkfs: MKFS_EXT3,
            fstype: "ext3",
            options: "data=writeback",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "ext3-journal",
        what: "Linux ext3 data=journal",
        kind: Kind::Kernel {
            mkfs: MKFS_EXT3,
            fstype: "ext3",
            options: "data=journal",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "ext4",
        what: "Linux ext4 (data=ordered)",
        kind: Kind::Kernel {
            mkfs: MKFS_EXT4,
            fstype: "ext4",
            options: "",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "fuse2fs",
        what: "fuse2fs (e2fsprogs, FUSE) on ext2",
        kind: Kind::Fuse2fs { mkfs: MKFS_EXT2 },
        safe: false,
        opt: None,
    },
    PASSTHROUGH,
    PASSTHROUGH_KERNEL,
    BINDFS,
    opt("quilt-su-opt-none", "nohard,nomerge", "none"),
    opt("quilt-su-opt-hard", "nomerge", "hard"),
    opt("quilt-su-opt-merge", "nohard", "merge"),
];

pub fn by_name(name: &str) -> Result<System> {
    SYSTEMS
        .iter()
        .copied()
        .find(|s| s.name == name)
        .with_context(|| {
            format!(
                "unknown system '{name}' (one of: {})",
                SYSTEMS
                    .iter()
                    .map(|s| s.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}
