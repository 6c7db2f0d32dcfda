//! A replicated volume as a [`BlockDevice`], so that every stack (ext2, betrfs, the
//! crash explorer) runs on it unchanged. A write returns once it is durable on f+1
//! replicas and its metadata is committed, so `flush` has nothing left to do.
//!
//! Addresses: `gnothi://HOST:PORT,HOST:PORT,…/VOLUME[?secret-file=PATH]`, the replicas
//! listed by id (the first is replica 0). The cluster secret comes from the file named
//! in the address, or from `QUILT_GNOTHI_SECRET`.

use crate::client::{Client, ClientConfig, ClientError};
use crate::transport::GrpcNet;
use quilt_block::{BlockDevice, BlockError, Capabilities, IoCounters, IoStats, WriteClass};
use std::collections::BTreeMap;

/// A parsed volume address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeAddress {
    pub replicas: Vec<String>,
    pub volume: String,
    pub secret_file: Option<String>,
    /// With TLS: the CA file the replicas' certificates chain to.
    pub tls_ca: Option<String>,
}

impl VolumeAddress {
    pub fn is_address(s: &str) -> bool {
        s.starts_with("gnothi://")
    }

    pub fn parse(s: &str) -> Result<VolumeAddress, String> {
        let rest = s.strip_prefix("gnothi://").ok_or_else(|| {
            format!("{s:?} is not a volume address (gnothi://HOST:PORT,…/VOLUME)")
        })?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (hosts, volume) = rest
            .split_once('/')
            .ok_or_else(|| format!("{s:?} names no volume (gnothi://HOST:PORT,…/VOLUME)"))?;
        let replicas: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .collect();
        if replicas.is_empty() || volume.is_empty() {
            return Err(format!(
                "{s:?} needs at least one HOST:PORT and a volume name"
            ));
        }
        for h in &replicas {
            if h.rsplit_once(':')
                .is_none_or(|(_, p)| p.parse::<u16>().is_err())
            {
                return Err(format!("{h:?} in {s:?} is not HOST:PORT"));
            }
        }
        let mut secret_file = None;
        let mut tls_ca = None;
        for kv in query.into_iter().flat_map(|q| q.split('&')) {
            match kv.split_once('=') {
                Some(("secret-file", v)) => secret_file = Some(v.to_string()),
                Some(("tls-ca", v)) => tls_ca = Some(v.to_string()),
                _ => {
                    return Err(format!(
                        "unknown option {kv:?} in {s:?} (known: secret-file=PATH, tls-ca=PATH)"
                    ))
                }
            }
        }
        Ok(VolumeAddress {
            replicas,
            volume: volume.to_string(),
            secret_file,
            tls_ca,
        })
    }

    /// The replicas by id: the address lists them in id order.
    pub fn peers(&self) -> BTreeMap<u64, String> {
        self.replicas
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, h)| (i as u64, h))
            .collect()
    }

    /// A client of the volume as client `id`: its replicas over gRPC with the
    /// volume's secret. Runs on the caller's tokio runtime.
    pub async fn connect(&self, id: u64, config: ClientConfig) -> Result<Client, String> {
        let secret = self.secret()?;
        let net = GrpcNet::with_tls(self.peers(), &secret, self.ca()?)?;
        Client::connect(net, self.replicas.len() as u16, id, config)
            .await
            .map_err(|e| e.to_string())
    }

    /// The CA named by `tls-ca=`, read (`None`: no TLS).
    pub fn ca(&self) -> Result<Option<Vec<u8>>, String> {
        self.tls_ca
            .as_ref()
            .map(|f| std::fs::read(f).map_err(|e| format!("reading the cluster CA {f}: {e}")))
            .transpose()
    }

    /// The cluster secret this address names (file or environment).
    pub fn secret(&self) -> Result<String, String> {
        if let Some(f) = &self.secret_file {
            return std::fs::read_to_string(f)
                .map(|s| s.trim().to_string())
                .map_err(|e| format!("reading the cluster secret {f}: {e}"));
        }
        std::env::var("QUILT_GNOTHI_SECRET").map_err(|_| {
            "no cluster secret: add ?secret-file=PATH to the address or set QUILT_GNOTHI_SECRET"
                .to_string()
        })
    }
}

pub struct ReplicatedDevice {
    rt: tokio::runtime::Runtime,
    client: Client,
    bs: usize,
    blocks: u64,
    counters: IoCounters,
    what: String,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> BlockError {
    BlockError::Unavailable {
        what: what.to_string(),
        why: e.to_string(),
    }
}

impl ReplicatedDevice {
    /// Connects to the volume at `address`.
    pub fn connect(address: &str) -> Result<ReplicatedDevice, BlockError> {
        let what = format!("volume {address}");
        let a = VolumeAddress::parse(address).map_err(|e| unavailable(&what, e))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| unavailable(&what, e))?;
        // Unique among this volume's clients: the process id and the time.
        let id = (u64::from(std::process::id()) << 32)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64 & 0xffff_ffff);
        let client = rt
            .block_on(a.connect(id, ClientConfig::default()))
            .map_err(|e| unavailable(&what, e))?;
        let status = rt
            .block_on(client.status(0))
            .or_else(|_| {
                (1..a.replicas.len() as u16)
                    .find_map(|r| rt.block_on(client.status(r)).ok())
                    .ok_or(())
            })
            .map_err(|()| unavailable(&what, "no replica answered its status"))?;
        if status.volume != a.volume {
            return Err(unavailable(
                &what,
                format!(
                    "the replicas serve volume {:?}, not {:?}",
                    status.volume, a.volume
                ),
            ));
        }
        let g = *client.geometry();
        Ok(ReplicatedDevice {
            rt,
            bs: g.block_size as usize,
            blocks: g.blocks,
            client,
            counters: IoCounters::default(),
            what,
        })
    }

    fn err(&self, e: ClientError) -> BlockError {
        match e {
            ClientError::OutOfRange { first, blocks, .. } => BlockError::OutOfRange {
                block: first,
                count: blocks,
            },
            ClientError::Unaligned { len, block_size } => BlockError::BadBufferSize {
                got: len,
                block_size,
            },
            e => unavailable(&self.what, e),
        }
    }
}

impl BlockDevice for ReplicatedDevice {
    fn block_size(&self) -> usize {
        self.bs
    }
    fn block_count(&self) -> u64 {
        self.blocks
    }
    fn read(&self, block: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.read_blocks(block, buf)
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        if buf.is_empty() || buf.len() % self.bs != 0 {
            return Err(BlockError::BadBufferSize {
                got: buf.len(),
                block_size: self.bs,
            });
        }
        let count = (buf.len() / self.bs) as u64;
        let data = self
            .rt
            .block_on(self.client.read(first, count))
            .map_err(|e| self.err(e))?;
        buf.copy_from_slice(&data);
        self.counters.read(buf.len());
        Ok(())
    }
    fn write(&self, block: u64, buf: &[u8], class: WriteClass) -> quilt_block::Result<()> {
        self.write_blocks(block, buf, class)
    }
    fn write_blocks(&self, first: u64, buf: &[u8], _class: WriteClass) -> quilt_block::Result<()> {
        if buf.is_empty() || buf.len() % self.bs != 0 {
            return Err(BlockError::BadBufferSize {
                got: buf.len(),
                block_size: self.bs,
            });
        }
        self.rt
            .block_on(self.client.write(first, buf))
            .map_err(|e| self.err(e))?;
        self.counters.write(buf.len());
        Ok(())
    }
    fn flush(&self) -> quilt_block::Result<()> {
        // Every write returned only once durable on f+1 replicas.
        self.counters.flush();
        Ok(())
    }
    fn stats(&self) -> IoStats {
        self.counters.snapshot()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_bad_ones_say_why() {
        let a =
            VolumeAddress::parse("gnothi://127.0.0.1:7000,10.0.0.2:7001/vol0?secret-file=/tmp/s")
                .unwrap();
        assert_eq!(a.replicas, vec!["127.0.0.1:7000", "10.0.0.2:7001"]);
        assert_eq!(a.volume, "vol0");
        assert_eq!(a.secret_file.as_deref(), Some("/tmp/s"));
        for bad in [
            "gnothi://",
            "gnothi://h:1",
            "gnothi:///vol",
            "gnothi://h/vol",
            "gnothi://h:99999/vol",
            "gnothi://h:1/vol?x=y",
            "file:///x",
        ] {
            assert!(VolumeAddress::parse(bad).is_err(), "{bad}");
        }
    }
}
