//! The Rust twin of `ordered_rename.c`: write a file, then rename it into place, the
//! rename ordered after the data by patchgroups instead of an fsync in between.
//! Run: `cargo run -p quilt-pg --example ordered_rename -- MOUNTPOINT`.

use quilt_pg::{Control, Error};

fn main() -> Result<(), Error> {
    let mount = std::env::args()
        .nth(1)
        .expect("usage: ordered_rename MOUNTPOINT");
    let ctl = Control::open(&mount)?;
    let data = ctl.create()?;
    ctl.release(data)?;
    ctl.engage(data)?;
    let tmp = format!("{mount}/note.tmp");
    std::fs::write(&tmp, "written before it was named\n").map_err(Error::io)?;
    ctl.disengage(data)?;
    let name = ctl.create_after(data)?;
    ctl.engage(name)?;
    std::fs::rename(&tmp, format!("{mount}/note")).map_err(Error::io)?;
    ctl.disengage(name)?;
    ctl.sync(name)?;
    match ctl.engage(data) {
        Err(e) => println!("refused as expected: {}", e.message),
        Ok(()) => panic!("engaging a group with afters should fail"),
    }
    ctl.abandon(data)?;
    ctl.abandon(name)?;
    println!("ok");
    Ok(())
}
