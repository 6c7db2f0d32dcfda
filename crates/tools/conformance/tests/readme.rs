//! The README's library example (the same code; keep the two in step), and what it
//! promises: the file's data, and the batch's directory and file under their granted
//! numbers.

use quilt_block::MemDevice;
use quilt_ext2::{MkfsOptions, Mode, MountOptions};
use quilt_vfs::{Ctx, FileSystem, FsOp};
use std::sync::Arc;

#[test]
fn the_readme_library_example_runs() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Arc::new(MemDevice::new(4096, 16384)?);
    let zeroed = MkfsOptions {
        device_is_zeroed: true,
        ..Default::default()
    };
    let (engine, _) = quilt_stack::mkfs_ext2(dev.clone(), Default::default(), &zeroed)?;
    quilt_stack::add_journal(engine, 1024, false)?; // ext3
    let mode = MountOptions {
        mode: Mode::MetaJournal,
        ..Default::default()
    };
    let fs = quilt_stack::ext2(dev.clone(), quilt_stack::Ext2Spec::mount(mode))?;
    let f = fs.mknod(fs.root(), b"hello", libc::S_IFREG | 0o644, 0, &Ctx::root())?;
    fs.write(f.ino, 0, b"world", &Ctx::root())?;
    fs.fsync(f.ino, false)?; // durable: the data, the inode, the entry, in order

    // Many operations as one: all of them or none, one transaction on disk, under inode
    // numbers granted in advance (a failure names the operation: BatchError { index, .. }).
    let g = fs.grant_inodes(2)?;
    fs.apply_batch(
        &[
            FsOp::Mkdir {
                parent: fs.root(),
                name: b"job".to_vec(),
                mode: 0o755,
                ino: Some(g.first),
            },
            FsOp::Mknod {
                parent: g.first,
                name: b"out".to_vec(),
                mode: libc::S_IFREG | 0o644,
                rdev: 0,
                ino: Some(g.first + 1),
            },
        ],
        &Ctx::root(),
    )?;
    fs.unmount()?;

    let fs = quilt_stack::ext2(dev, quilt_stack::Ext2Spec::default())?;
    let hello = fs.lookup(fs.root(), b"hello")?;
    assert_eq!(fs.read(hello.ino, 0, 16)?, b"world");
    let job = fs.lookup(fs.root(), b"job")?;
    assert_eq!(job.ino, g.first);
    assert_eq!(fs.lookup(job.ino, b"out")?.ino, g.first + 1);
    Ok(())
}
