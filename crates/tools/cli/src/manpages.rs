//! `quiltfs manpages DIR` (hidden; the Debian package runs it): a page per command and
//! subcommand from the command-line definitions (quiltfs(1), quiltfs-mount(1),
//! quiltfs-replica-serve(1), ...), the mount options' page from their table, and the
//! formats' page kept beside the code (docs/man). `quiltfs bench`'s pages come from the
//! benchmark binary, which owns those definitions (`quiltfs-bench manpages DIR`).

use anyhow::{Context, Result};
use clap::CommandFactory;
use std::path::Path;

/// The page of the image formats: hand-written, as no definition in code holds it.
const FORMATS_PAGE: &str = include_str!("../../../../docs/man/quiltfs-formats.5");

pub fn write_all(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut cmd = crate::Cli::command().disable_help_subcommand(true);
    cmd.build();
    let mut written = 0;
    pages(&cmd, dir, &mut written)?;
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).with_context(|| format!("writing {name}"))
    };
    let version = env!("CARGO_PKG_VERSION");
    write(
        "quiltfs-mount-options.7",
        &crate::mount_options::man_page(version),
    )?;
    write("quiltfs-formats.5", FORMATS_PAGE)?;
    eprintln!(
        "quiltfs: {} man pages written to {}",
        written + 2,
        dir.display()
    );
    Ok(())
}

fn pages(cmd: &clap::Command, dir: &Path, written: &mut usize) -> Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        // The benchmark binary writes quiltfs-bench(1) and its suites' pages.
        if cmd.get_name() == "quiltfs" && sub.get_name() == "bench" {
            continue;
        }
        pages(sub, dir, written)?;
    }
    clap_mangen::Man::new(cmd.clone())
        .manual("quiltfs")
        .generate_to(dir)
        .with_context(|| format!("writing the page of {}", cmd.get_name()))?;
    *written += 1;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_page_for_every_visible_subcommand_and_the_two_topics() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        super::write_all(dir.path()).expect("pages written");
        let has = |n: &str| dir.path().join(n).is_file();
        for page in [
            "quiltfs.1",
            "quiltfs-mount.1",
            "quiltfs-mkfs.1",
            "quiltfs-replica-serve.1",
            "quiltfs-mds-serve.1",
            "quiltfs-mds-policy-set.1",
            "quiltfs-cluster-up.1",
            "quiltfs-completions.1",
            "quiltfs-mount-options.7",
            "quiltfs-formats.5",
        ] {
            assert!(has(page), "{page} missing");
        }
        assert!(!has("quiltfs-manpages.1"), "hidden commands get no page");
        assert!(!has("quiltfs-bench.1"), "the bench binary writes its own");
        let mount = std::fs::read_to_string(dir.path().join("quiltfs-mount.1")).expect("read");
        assert!(mount.contains("\\-\\-foreground"), "the options are listed");
    }
}
