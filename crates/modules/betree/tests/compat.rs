//! A tree written before node format version 4 (whose internal nodes' buffers have one
//! checksum and no runs) opens and reads right, takes writes that mix new nodes with
//! old ones, and compacts into new ones.
//!
//! `fixtures/tree-v3.img.gz` was made by the quiltfs of commit a856637 (node version 3):
//!
//! ```sh
//! quiltfs kv create v3.img --size 64M --node-size 8K --basement-size 1K --fanout 8
//! for i in $(seq 0 2999); do j=$(( i * 7919 % 3000 ))            # then as in `model`
//!   quiltfs kv put v3.img $(printf 'k%05d' $j) "v$j-<j % 40 x's>"; done
//! for j in $(seq 0 10 2999); do quiltfs kv delete v3.img $(printf 'k%05d' $j); done
//! quiltfs kv delete-range v3.img k01000 k01200
//! for j in $(seq 0 199); do quiltfs kv put v3.img $(printf 'k%05d' $(( j * 13 % 3000 ))) "w$j"; done
//! ```
//!
//! Each command was a process of its own, closing the tree with a checkpoint: the image
//! has a root and internal nodes whose buffers hold messages, a range delete among them.

use quilt_betree::{Options, Tree};
use quilt_block::MemDevice;
use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Arc;

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

fn model() -> Model {
    let key = |j: u64| format!("k{j:05}").into_bytes();
    let mut m = Model::new();
    for i in 0..3000u64 {
        let j = i * 7919 % 3000;
        m.insert(
            key(j),
            format!("v{j}-{}", "x".repeat((j % 40) as usize)).into_bytes(),
        );
    }
    for j in (0..3000).step_by(10) {
        m.remove(&key(j));
    }
    m.retain(|k, _| !(k.as_slice() >= b"k01000".as_slice() && k.as_slice() < b"k01200".as_slice()));
    for j in 0..200u64 {
        m.insert(key(j * 13 % 3000), format!("w{j}").into_bytes());
    }
    m
}

fn fixture() -> Arc<MemDevice> {
    let gz = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tree-v3.img.gz"
    ))
    .expect("the fixture");
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut bytes)
        .expect("a gzip file");
    Arc::new(MemDevice::from_bytes(4096, &bytes).expect("whole blocks"))
}

/// Every key of the model (and a few absent ones) by point query, and the whole tree
/// by scans both ways.
fn check(t: &Tree, m: &Model, when: &str) {
    for (k, v) in m {
        assert_eq!(
            t.get(k).unwrap().as_deref(),
            Some(v.as_slice()),
            "{when}: {k:?}"
        );
    }
    for k in [&b"k00010"[..], b"k01100", b"k01199", b"k99999", b"a"] {
        assert_eq!(t.get(k).unwrap(), m.get(k).cloned(), "{when}: {k:?}");
    }
    let up: Model = t.range(b"", None).map(|e| e.unwrap()).collect();
    assert!(up == *m, "{when}: scan differs");
    let down: Vec<_> = t.range_rev(b"", None).map(|e| e.unwrap()).collect();
    assert!(
        down.iter().rev().eq(m
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
            .iter()),
        "{when}: backward scan differs"
    );
}

#[test]
fn a_version_3_tree_reads_takes_writes_and_compacts() {
    let dev = fixture();
    let mut m = model();
    let t = Tree::open(dev.clone(), Options::default()).unwrap();
    assert!(t.stats().height >= 2, "the fixture has internal nodes");
    check(&t, &m, "as written by version 3");
    t.check().unwrap();
    // Writes: new nodes (version 4) beside old ones, through a checkpoint and a reopen.
    for j in 0..1500u64 {
        let k = format!("k{:05}", j * 7 % 3000).into_bytes();
        let v = format!("n{j}").into_bytes();
        t.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    t.delete_range(b"k02000", b"k02100").unwrap();
    m.retain(|k, _| !(k.as_slice() >= b"k02000".as_slice() && k.as_slice() < b"k02100".as_slice()));
    t.close().unwrap();
    let t = Tree::open(dev.clone(), Options::default()).unwrap();
    check(&t, &m, "after writes");
    // Every node rewritten.
    t.compact().unwrap();
    t.close().unwrap();
    let t = Tree::open(dev, Options::default()).unwrap();
    check(&t, &m, "after compaction");
    t.check().unwrap();
}
