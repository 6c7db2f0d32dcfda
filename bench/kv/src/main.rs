//! The key-value benchmark of issue 19: the quiltfs Bε-tree against redb (B-tree), fjall
//! (LSM) and RocksDB (LSM, through its Rust crate), on files in one directory of the same
//! disk, with the same cache budget and the same durability points.
//!
//! Phases, each system on fresh stores:
//! * `seq_insert`, `rand_insert`: N keys (16 B) with 100 B values, in batches of 100
//!   (one transaction / write batch each, not durable), a durable sync every 100,000 keys
//!   and at the end;
//! * `point_get`: random existing keys of the random store, after reopening it;
//! * `scan_1000`: range scans of 1,000 keys from random existing keys;
//! * `upsert_4b`: random 4-byte writes into 4 KiB values (the Bε-tree's upsert message;
//!   a read-modify-write in one transaction for the others), batches of 100;
//! * `range_delete_10pct`: deletes a tenth of the random store's keys (one contiguous
//!   range), then syncs: one message for the Bε-tree, `delete_range` for RocksDB,
//!   `retain_in` for redb, iterate-and-remove for fjall.
//!
//! Write amplification: bytes written to the disk that holds `--dir` during the phase
//! and the store's close (its sectors written, from `/sys/dev/block`, with a `sync`
//! before and after so that no other phase's page cache lands in it) over the key and
//! value bytes the phase inserted. Run nothing else on that disk meanwhile. (The
//! process's `write_bytes` in `/proc/self/io` is not used: it charges a whole large folio
//! of the page cache each time a part of it is dirtied, which overstated a store that
//! writes 256 KiB runs and then single blocks near them by about 3.6 times; the disk's
//! own count did not move.)

use anyhow::{bail, Context, Result};

#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
use clap::Parser;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Parser, Clone)]
struct Args {
    /// Keys inserted by the insert phases.
    #[arg(long, default_value_t = 1_000_000)]
    keys: u64,
    /// Rounds (each runs every system on fresh stores; the order rotates).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Systems, comma-separated.
    #[arg(long, default_value = "betree,redb,fjall,rocksdb")]
    systems: String,
    /// Directory for the stores (one disk for all).
    #[arg(long, default_value = "/var/tmp/quiltfs-kvbench")]
    dir: PathBuf,
    /// Cache for each system, MiB.
    #[arg(long, default_value_t = 64)]
    cache_mb: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Bε-tree node size, KiB (to compare geometries).
    #[arg(long, default_value_t = 256)]
    node_kb: usize,
    /// Bε-tree basement size, KiB.
    #[arg(long, default_value_t = 4)]
    basement_kb: usize,
    /// Bε-tree fanout.
    #[arg(long, default_value_t = 16)]
    fanout: usize,
    /// Bε-tree dirty nodes at most, in percent of its node cache.
    #[arg(long, default_value_t = 75)]
    dirty_pct: usize,
    /// Largest delta of a Bε-tree leaf, KiB (0: every flush rewrites the leaf).
    #[arg(long, default_value_t = 64)]
    delta_kb: usize,
    /// Drop the kernel's page cache before the read phases (needs root).
    #[arg(long)]
    drop_caches: bool,
    /// Only these phases (comma-separated; the read phases need rand_insert).
    #[arg(
        long,
        default_value = "seq_insert,rand_insert,point_get,scan_1000,range_delete_10pct,upsert_4b"
    )]
    phases: String,
    /// Print each store's own counters after each phase.
    #[arg(long)]
    verbose: bool,
    /// Keep the random store after the run, and read the one an earlier `--reuse` run
    /// kept when `rand_insert` is not among the phases (to compare two builds' read
    /// paths on one store; with `--runs 1`).
    #[arg(long)]
    reuse: bool,
    /// Point queries (default: a tenth of the keys, 1,000 to 200,000).
    #[arg(long)]
    queries: Option<u64>,
    /// Range scans (default: one per 1,000 keys, 100 to 5,000).
    #[arg(long)]
    scans: Option<u64>,
    /// (Internal) Run only this system, round `--round`, and write its samples as JSON
    /// here: each system and round runs in a process of its own, so that one's memory
    /// (its allocator's retained pages, the peak RSS) is not charged to the next.
    #[arg(long, hide = true)]
    one: Option<PathBuf>,
    #[arg(long, hide = true, default_value_t = 0)]
    round: usize,
}

const BATCH: usize = 100;
const SYNC_EVERY: u64 = 100_000;
const VALUE: usize = 100;
const BIG_VALUE: usize = 4096;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Key `i` of the random store: a hash prefix scatters them over the key space.
fn rand_key(i: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&mix(i).to_be_bytes());
    k[8..].copy_from_slice(&i.to_be_bytes());
    k
}

fn seq_key(i: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[8..].copy_from_slice(&i.to_be_bytes());
    k
}

fn value(i: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut x = i;
    while v.len() < len {
        x = mix(x);
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

trait Store {
    fn put_batch(&self, kvs: &[([u8; 16], Vec<u8>)]) -> Result<()>;
    fn sync(&self) -> Result<()>;
    fn get(&self, k: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Reads `n` entries from `from` on; returns how many there were.
    fn scan(&self, from: &[u8], n: usize) -> Result<usize>;
    /// Writes 4 bytes at `off` of each key's value, as one batch.
    fn write4(&self, ups: &[([u8; 16], usize, [u8; 4])]) -> Result<()>;
    fn delete_range(&self, a: &[u8], b: &[u8]) -> Result<()>;
    fn close(self: Box<Self>) -> Result<()>;
    /// The store's own counters, if it keeps any (printed with `--verbose`).
    fn counters(&self) -> Option<String> {
        None
    }
}

// ---- the Bε-tree ----

struct Betree(quilt_betree::Tree);

fn betree_options(a: &Args) -> quilt_betree::Options {
    // The engine's cache holds only blocks being written: the nodes get the rest.
    let engine = (a.cache_mb << 20) / 8;
    quilt_betree::Options {
        node_bytes: a.node_kb << 10,
        basement_bytes: a.basement_kb << 10,
        fanout: a.fanout,
        delta_bytes: a.delta_kb << 10,
        cache_bytes: (a.cache_mb << 20) - engine,
        dirty_bytes: ((a.cache_mb << 20) - engine) / 100 * a.dirty_pct,
        engine_cache_bytes: engine,
        ..Default::default()
    }
}

impl Betree {
    fn open(path: &Path, a: &Args, create: bool) -> Result<Betree> {
        // Room for the data several times over (sparse).
        let blocks = ((a.keys * 400).max(1 << 30) / 4096).max(1 << 18);
        if create {
            let _ = std::fs::remove_file(path);
        }
        let spec = quilt_stack::ImageSpec {
            create_bytes: create.then_some(blocks * 4096),
            ..quilt_stack::ImageSpec::new(path, 4096, false)
        };
        let dev = quilt_stack::device(quilt_stack::DeviceSpec::image(spec))?.dev;
        Ok(Betree(if create {
            quilt_stack::create_tree(dev, betree_options(a))?
        } else {
            quilt_stack::tree(dev, betree_options(a))?
        }))
    }
}

impl Store for Betree {
    fn put_batch(&self, kvs: &[([u8; 16], Vec<u8>)]) -> Result<()> {
        let mut b = quilt_betree::Batch::new();
        for (k, v) in kvs {
            b.put(k, v);
        }
        Ok(self.0.write(b)?)
    }
    fn sync(&self) -> Result<()> {
        Ok(self.0.sync()?)
    }
    fn get(&self, k: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.0.get(k)?)
    }
    fn scan(&self, from: &[u8], n: usize) -> Result<usize> {
        // The lending iterator: entries are read in place, as redb's guards are. The
        // count is passed on (as a limit, which sizes the tree's reads), since the
        // caller knows it.
        let mut c = 0;
        let mut it = self.0.range(from, None).limit(n);
        while c < n {
            let Some(e) = it.next_entry() else { break };
            std::hint::black_box(e?);
            c += 1;
        }
        Ok(c)
    }
    fn write4(&self, ups: &[([u8; 16], usize, [u8; 4])]) -> Result<()> {
        let mut b = quilt_betree::Batch::new();
        for (k, off, bytes) in ups {
            b.upsert(
                k,
                quilt_betree::WRITE_AT,
                &quilt_betree::write_at_arg(*off as u64, bytes),
            );
        }
        Ok(self.0.write(b)?)
    }
    fn delete_range(&self, a: &[u8], b: &[u8]) -> Result<()> {
        Ok(self.0.delete_range(a, b)?)
    }
    fn close(self: Box<Self>) -> Result<()> {
        Ok(self.0.close()?)
    }
    fn counters(&self) -> Option<String> {
        serde_json::to_string(&self.0.stats()).ok()
    }
}

// ---- redb ----

const TABLE: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("t");

struct Redb(redb::Database);

impl Redb {
    fn open(path: &Path, a: &Args) -> Result<Redb> {
        let db = redb::Builder::new()
            .set_cache_size(a.cache_mb << 20)
            .create(path)?;
        Ok(Redb(db))
    }
    fn txn(&self) -> Result<redb::WriteTransaction> {
        let mut tx = self.0.begin_write()?;
        tx.set_durability(redb::Durability::None);
        Ok(tx)
    }
}

impl Store for Redb {
    fn put_batch(&self, kvs: &[([u8; 16], Vec<u8>)]) -> Result<()> {
        let tx = self.txn()?;
        {
            let mut t = tx.open_table(TABLE)?;
            for (k, v) in kvs {
                t.insert(k.as_slice(), v.as_slice())?;
            }
        }
        tx.commit()?;
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        // An empty durable commit makes the earlier non-durable ones durable.
        let mut tx = self.0.begin_write()?;
        tx.set_durability(redb::Durability::Immediate);
        tx.open_table(TABLE)?;
        tx.commit()?;
        Ok(())
    }
    fn get(&self, k: &[u8]) -> Result<Option<Vec<u8>>> {
        let tx = self.0.begin_read()?;
        let t = tx.open_table(TABLE)?;
        Ok(t.get(k)?.map(|g| g.value().to_vec()))
    }
    fn scan(&self, from: &[u8], n: usize) -> Result<usize> {
        let tx = self.0.begin_read()?;
        let t = tx.open_table(TABLE)?;
        let mut c = 0;
        for e in t.range(from..)?.take(n) {
            let (k, v) = e?;
            std::hint::black_box((k.value(), v.value()));
            c += 1;
        }
        Ok(c)
    }
    fn write4(&self, ups: &[([u8; 16], usize, [u8; 4])]) -> Result<()> {
        use redb::ReadableTable;
        let tx = self.txn()?;
        {
            let mut t = tx.open_table(TABLE)?;
            for (k, off, bytes) in ups {
                let mut v = t
                    .get(k.as_slice())?
                    .map(|g| g.value().to_vec())
                    .unwrap_or_default();
                if v.len() < off + 4 {
                    v.resize(off + 4, 0);
                }
                v[*off..off + 4].copy_from_slice(bytes);
                t.insert(k.as_slice(), v.as_slice())?;
            }
        }
        tx.commit()?;
        Ok(())
    }
    fn delete_range(&self, a: &[u8], b: &[u8]) -> Result<()> {
        let tx = self.txn()?;
        {
            let mut t = tx.open_table(TABLE)?;
            t.retain_in(a..b, |_, _| false)?;
        }
        tx.commit()?;
        Ok(())
    }
    fn close(self: Box<Self>) -> Result<()> {
        self.sync()
    }
}

// ---- fjall ----

struct Fjall {
    ks: fjall::Keyspace,
    part: fjall::PartitionHandle,
}

impl Fjall {
    fn open(path: &Path, a: &Args) -> Result<Fjall> {
        let ks = fjall::Config::new(path)
            .cache_size((a.cache_mb as u64) << 20)
            .open()?;
        let part = ks.open_partition("t", fjall::PartitionCreateOptions::default())?;
        Ok(Fjall { ks, part })
    }
}

impl Store for Fjall {
    fn put_batch(&self, kvs: &[([u8; 16], Vec<u8>)]) -> Result<()> {
        let mut b = self.ks.batch();
        for (k, v) in kvs {
            b.insert(&self.part, k.as_slice(), v.as_slice());
        }
        b.commit()?;
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        self.ks.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
    }
    fn get(&self, k: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.part.get(k)?.map(|s| s.to_vec()))
    }
    fn scan(&self, from: &[u8], n: usize) -> Result<usize> {
        let mut c = 0;
        for e in self.part.range(from.to_vec()..).take(n) {
            std::hint::black_box(e?);
            c += 1;
        }
        Ok(c)
    }
    fn write4(&self, ups: &[([u8; 16], usize, [u8; 4])]) -> Result<()> {
        let mut b = self.ks.batch();
        for (k, off, bytes) in ups {
            let mut v = self.part.get(k)?.map(|s| s.to_vec()).unwrap_or_default();
            if v.len() < off + 4 {
                v.resize(off + 4, 0);
            }
            v[*off..off + 4].copy_from_slice(bytes);
            b.insert(&self.part, k.as_slice(), v);
        }
        b.commit()?;
        Ok(())
    }
    fn delete_range(&self, a: &[u8], b: &[u8]) -> Result<()> {
        let mut batch = self.ks.batch();
        let mut n = 0;
        for e in self.part.range(a.to_vec()..b.to_vec()) {
            let (k, _) = e?;
            batch.remove(&self.part, k);
            n += 1;
            if n % 10_000 == 0 {
                batch.commit()?;
                batch = self.ks.batch();
            }
        }
        batch.commit()?;
        Ok(())
    }
    fn close(self: Box<Self>) -> Result<()> {
        self.sync()
    }
}

// ---- RocksDB ----

#[cfg(feature = "rocksdb")]
struct Rocks(rocksdb::DB);

#[cfg(feature = "rocksdb")]
impl Rocks {
    fn open(path: &Path, a: &Args) -> Result<Rocks> {
        let mut o = rocksdb::Options::default();
        o.create_if_missing(true);
        let cache = rocksdb::Cache::new_lru_cache(a.cache_mb << 20);
        let mut bb = rocksdb::BlockBasedOptions::default();
        bb.set_block_cache(&cache);
        o.set_block_based_table_factory(&bb);
        Ok(Rocks(rocksdb::DB::open(&o, path)?))
    }
}

#[cfg(feature = "rocksdb")]
impl Store for Rocks {
    fn put_batch(&self, kvs: &[([u8; 16], Vec<u8>)]) -> Result<()> {
        let mut b = rocksdb::WriteBatch::default();
        for (k, v) in kvs {
            b.put(k, v);
        }
        self.0.write(b)?;
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        self.0.flush_wal(true)?;
        Ok(())
    }
    fn get(&self, k: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.0.get(k)?)
    }
    fn scan(&self, from: &[u8], n: usize) -> Result<usize> {
        // The raw iterator lends its entries (the boxed one copies each).
        let mut it = self.0.raw_iterator();
        it.seek(from);
        let mut c = 0;
        while c < n && it.valid() {
            std::hint::black_box((it.key(), it.value()));
            c += 1;
            it.next();
        }
        it.status()?;
        Ok(c)
    }
    fn write4(&self, ups: &[([u8; 16], usize, [u8; 4])]) -> Result<()> {
        let mut b = rocksdb::WriteBatch::default();
        for (k, off, bytes) in ups {
            let mut v = self.0.get(k)?.unwrap_or_default();
            if v.len() < off + 4 {
                v.resize(off + 4, 0);
            }
            v[*off..off + 4].copy_from_slice(bytes);
            b.put(k, v);
        }
        self.0.write(b)?;
        Ok(())
    }
    fn delete_range(&self, a: &[u8], b: &[u8]) -> Result<()> {
        let mut wb = rocksdb::WriteBatch::default();
        wb.delete_range(a, b);
        self.0.write(wb)?;
        Ok(())
    }
    fn close(self: Box<Self>) -> Result<()> {
        self.sync()
    }
}

// ---- the harness ----

fn open(system: &str, path: &Path, a: &Args, create: bool) -> Result<Box<dyn Store>> {
    Ok(match system {
        "betree" => Box::new(Betree::open(path, a, create)?),
        "redb" => Box::new(Redb::open(path, a)?),
        "fjall" => Box::new(Fjall::open(path, a)?),
        #[cfg(feature = "rocksdb")]
        "rocksdb" => Box::new(Rocks::open(path, a)?),
        s => bail!("unknown system {s}"),
    })
}

/// Resets the process's peak resident set (VmHWM), so that the next reading is the
/// peak of what runs from now on.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The peak resident set since the last reset, MiB.
fn peak_rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Bytes written to the disk holding `dir` so far (after a `sync`), or, where the disk
/// cannot be found, the process's own `write_bytes`.
fn disk_written(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let sectors = std::fs::metadata(dir).ok().and_then(|m| {
        let dev = m.dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let stat = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat")).ok()?;
        stat.split_whitespace().nth(6)?.parse::<u64>().ok()
    });
    match sectors {
        Some(s) => s * 512,
        None => io_written(),
    }
}

fn io_written() -> u64 {
    let s = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("write_bytes: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn du(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::metadata(path) else {
        return 0;
    };
    if m.is_file() {
        return m.blocks() * 512;
    }
    std::fs::read_dir(path)
        .map(|d| d.flatten().map(|e| du(&e.path())).sum())
        .unwrap_or(0)
}

#[derive(serde::Serialize, serde::Deserialize, Clone)]
struct Measure {
    system: String,
    phase: String,
    run: usize,
    ops: u64,
    seconds: f64,
    ops_per_sec: f64,
    /// Bytes written to storage over the key and value bytes inserted (insert and
    /// upsert phases).
    write_amp: Option<f64>,
    disk_bytes: u64,
    /// The process's peak resident set during the phase, MiB (every system runs in this
    /// process, one after the other; the peak is reset before each phase).
    peak_rss_mib: f64,
}

/// Keys `key(0..n)` with values of `len` bytes, in batches, synced every `SYNC_EVERY`
/// and at the end.
fn insert(store: &dyn Store, n: u64, key: fn(u64) -> [u8; 16], len: usize) -> Result<()> {
    let mut batch = Vec::with_capacity(BATCH);
    for i in 0..n {
        batch.push((key(i), value(i, len)));
        if batch.len() == BATCH {
            store.put_batch(&batch)?;
            batch.clear();
        }
        if (i + 1) % SYNC_EVERY == 0 {
            store.sync()?;
        }
    }
    if !batch.is_empty() {
        store.put_batch(&batch)?;
    }
    store.sync()
}

fn run_system(system: &str, run: usize, a: &Args, out: &mut Vec<Measure>) -> Result<()> {
    let dir = a.dir.join(format!("{system}-{run}"));
    if !a.reuse {
        let _ = std::fs::remove_dir_all(&dir);
    }
    std::fs::create_dir_all(&dir)?;
    let path = |name: &str| {
        let p = dir.join(name);
        if system != "betree" {
            let _ = std::fs::create_dir_all(&p);
        }
        if system == "redb" {
            p.join("db.redb")
        } else {
            p
        }
    };
    let mut record = |phase: &str, ops: u64, t: f64, wa: Option<f64>, disk: u64| {
        let rss = peak_rss_mib();
        eprintln!(
            "  {system:8} {phase:20} {:>12.0} ops/s  ({t:.2} s{}, peak RSS {rss:.0} MiB)",
            ops as f64 / t,
            wa.map(|w| format!(", write amp {w:.1}"))
                .unwrap_or_default()
        );
        out.push(Measure {
            system: system.into(),
            phase: phase.into(),
            run,
            ops,
            seconds: t,
            ops_per_sec: ops as f64 / t,
            write_amp: wa,
            disk_bytes: disk,
            peak_rss_mib: rss,
        });
    };
    let n = a.keys;
    let user = (n * (16 + VALUE as u64)) as f64;
    let want = |p: &str| a.phases.split(',').any(|x| x == p);
    // Sequential inserts.
    if want("seq_insert") {
        let p = path("seq");
        let s = open(system, &p, a, true)?;
        reset_peak_rss();
        let (w0, t0) = (disk_written(&a.dir), Instant::now());
        insert(s.as_ref(), n, seq_key, VALUE)?;
        let t = t0.elapsed().as_secs_f64();
        if a.verbose {
            eprintln!("    {}", s.counters().unwrap_or_default());
        }
        s.close()?;
        let wa = disk_written(&a.dir).saturating_sub(w0) as f64 / user;
        record("seq_insert", n, t, Some(wa), du(&p));
        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
    }
    // Random inserts, then queries on that store.
    let p = path("rand");
    if want("rand_insert") {
        let s = open(system, &p, a, true)?;
        reset_peak_rss();
        let (w0, t0) = (disk_written(&a.dir), Instant::now());
        insert(s.as_ref(), n, rand_key, VALUE)?;
        let t = t0.elapsed().as_secs_f64();
        if a.verbose {
            eprintln!("    {}", s.counters().unwrap_or_default());
        }
        s.close()?;
        let wa = disk_written(&a.dir).saturating_sub(w0) as f64 / user;
        record("rand_insert", n, t, Some(wa), du(&p));
    }
    if a.drop_caches {
        quilt_bench::drop_caches()?;
    }
    // The read phases run together, in this order, on the random store.
    if want("point_get") || want("scan_1000") || want("range_delete_10pct") {
        let s = open(system, &p, a, false)?;
        let q = a.queries.unwrap_or((n / 10).clamp(1000, 200_000));
        if want("point_get") {
            reset_peak_rss();
            let t0 = Instant::now();
            for i in 0..q {
                let k = mix(i ^ 0x5555) % n;
                if s.get(&rand_key(k))?.is_none() {
                    bail!("{system}: key {k} missing");
                }
            }
            record("point_get", q, t0.elapsed().as_secs_f64(), None, 0);
            if a.verbose {
                eprintln!("    {}", s.counters().unwrap_or_default());
            }
        }
        let scans = a.scans.unwrap_or((n / 1000).clamp(100, 5000));
        if want("scan_1000") {
            reset_peak_rss();
            let t0 = Instant::now();
            let mut got = 0;
            for i in 0..scans {
                got += s.scan(&rand_key(mix(i ^ 0xaaaa) % n), 1000)?;
            }
            if got < scans as usize * 900 {
                bail!("{system}: scans returned {got} entries for {scans} scans");
            }
            record("scan_1000", scans, t0.elapsed().as_secs_f64(), None, 0);
            if a.verbose {
                eprintln!("    {}", s.counters().unwrap_or_default());
            }
        }
        if want("range_delete_10pct") {
            // A tenth of the hash-prefixed key space, as one contiguous range.
            let end = (u64::MAX / 10).to_be_bytes();
            reset_peak_rss();
            let t0 = Instant::now();
            s.delete_range(&[0u8; 8], &end)?;
            s.sync()?;
            let t = t0.elapsed().as_secs_f64();
            if s.get(&rand_key(
                (0..n).find(|&i| mix(i) < u64::MAX / 10).unwrap_or(0),
            ))?
            .is_some()
            {
                bail!("{system}: a deleted key is still there");
            }
            record("range_delete_10pct", n / 10, t, None, 0);
        }
        s.close()?;
    }
    if !a.reuse {
        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
    }
    // Upserts into 4 KiB values.
    if want("upsert_4b") {
        let p = path("upsert");
        let m = (n / 32).max(1000);
        let s = open(system, &p, a, true)?;
        insert(s.as_ref(), m, rand_key, BIG_VALUE)?;
        let u = m * 4;
        reset_peak_rss();
        let (w0, t0) = (disk_written(&a.dir), Instant::now());
        let mut ups = Vec::with_capacity(BATCH);
        for i in 0..u {
            let x = mix(i ^ 0x1234);
            ups.push((
                rand_key(x % m),
                ((x >> 32) % (BIG_VALUE as u64 - 4)) as usize,
                (x as u32).to_le_bytes(),
            ));
            if ups.len() == BATCH {
                s.write4(&ups)?;
                ups.clear();
            }
            if (i + 1) % SYNC_EVERY == 0 {
                s.sync()?;
            }
        }
        if !ups.is_empty() {
            s.write4(&ups)?;
        }
        s.sync()?;
        let t = t0.elapsed().as_secs_f64();
        // Check one value against the writes made to it.
        let probe = rand_key(mix(0x1234) % m);
        let mut want = value(mix(0x1234) % m, BIG_VALUE);
        for i in 0..u {
            let x = mix(i ^ 0x1234);
            if rand_key(x % m) == probe {
                let off = ((x >> 32) % (BIG_VALUE as u64 - 4)) as usize;
                want[off..off + 4].copy_from_slice(&(x as u32).to_le_bytes());
            }
        }
        if s.get(&probe)?.as_deref() != Some(want.as_slice()) {
            bail!("{system}: an upserted value is wrong");
        }
        s.close()?;
        let wa = disk_written(&a.dir).saturating_sub(w0) as f64 / (u * 20) as f64;
        record("upsert_4b", u, t, Some(wa), du(&p));
        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
    }
    if !a.reuse {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

/// The median, from the suites' shared helper.
fn median(v: &[f64]) -> f64 {
    quilt_bench::median(v.to_vec()).0
}

fn main() -> Result<()> {
    let a = Args::parse();
    let systems: Vec<String> = a.systems.split(',').map(str::to_string).collect();
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let mut out = Vec::new();
    if let Some(path) = &a.one {
        run_system(&a.systems, a.round, &a, &mut out)
            .with_context(|| format!("{}, run {}", a.systems, a.round))?;
        std::fs::write(path, serde_json::to_string(&out)?)?;
        return Ok(());
    }
    let me = std::env::current_exe().context("finding this program")?;
    // The child gets the same settings, for one system and one round, no report.
    let mut args = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let name = x.split('=').next().unwrap_or_default();
        if ["--systems", "--json", "--runs"].contains(&name) {
            if !x.contains('=') {
                it.next();
            }
            continue;
        }
        args.push(x);
    }
    for run in 0..a.runs {
        for j in 0..systems.len() {
            let s = &systems[(j + run) % systems.len()];
            eprintln!("run {run}: {s}");
            let samples = a.dir.join(format!("samples-{s}-{run}.json"));
            let status = std::process::Command::new(&me)
                .args(&args)
                .args(["--systems", s, "--round", &run.to_string(), "--one"])
                .arg(&samples)
                .status()
                .with_context(|| format!("starting {}", me.display()))?;
            if !status.success() {
                bail!("{s}, run {run}: {status}");
            }
            let got: Vec<Measure> = serde_json::from_str(&std::fs::read_to_string(&samples)?)?;
            let _ = std::fs::remove_file(&samples);
            out.extend(got);
        }
    }
    let phases = [
        "seq_insert",
        "rand_insert",
        "point_get",
        "scan_1000",
        "upsert_4b",
        "range_delete_10pct",
    ];
    println!("# Key-value benchmark: {} keys, {} runs, cache {} MiB, Bε-tree nodes {} KiB / basements {} KiB / fanout {} / leaf deltas up to {} KiB",
        a.keys, a.runs, a.cache_mb, a.node_kb, a.basement_kb, a.fanout, a.delta_kb);
    println!();
    println!("| phase | system | ops/s median (min–max) | vs redb | vs rocksdb | write amp | disk MiB | peak RSS MiB |");
    println!("|---|---|---|---|---|---|---|---|");
    let med = |sys: &str, ph: &str| {
        let v: Vec<f64> = out
            .iter()
            .filter(|m| m.system == sys && m.phase == ph)
            .map(|m| m.ops_per_sec)
            .collect();
        if v.is_empty() {
            None
        } else {
            Some(median(&v))
        }
    };
    for ph in phases {
        for s in &systems {
            let ms: Vec<&Measure> = out
                .iter()
                .filter(|m| &m.system == s && m.phase == ph)
                .collect();
            if ms.is_empty() {
                continue;
            }
            let mut r: Vec<f64> = ms.iter().map(|m| m.ops_per_sec).collect();
            r.sort_by(f64::total_cmp);
            let w: Vec<f64> = ms.iter().filter_map(|m| m.write_amp).collect();
            let d: Vec<f64> = ms.iter().map(|m| m.disk_bytes as f64).collect();
            let rss: Vec<f64> = ms.iter().map(|m| m.peak_rss_mib).collect();
            let m = median(&r);
            let ratio = |o: &str| {
                med(o, ph)
                    .map(|x| format!("{:.2}×", m / x))
                    .unwrap_or("–".into())
            };
            println!(
                "| {ph} | {s} | {m:.0} ({:.0}–{:.0}) | {} | {} | {} | {} | {:.0} |",
                r[0],
                r[r.len() - 1],
                ratio("redb"),
                ratio("rocksdb"),
                if w.is_empty() {
                    "–".into()
                } else {
                    format!("{:.1}", median(&w))
                },
                if d.iter().all(|&x| x == 0.0) {
                    "–".into()
                } else {
                    format!("{:.0}", median(&d) / 1048576.0)
                },
                median(&rss),
            );
        }
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&out)?)?;
        std::fs::write(p.with_extension("csv"), quilt_bench::csv(&out)?)?;
    }
    Ok(())
}
