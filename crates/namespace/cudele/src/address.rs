//! The service's address as commands take it:
//! `mds://HOST:PORT[/SUBTREE][?secret-file=PATH&tls-ca=PATH]`. The shared secret
//! comes from the file it names, or from `QUILTFS_MDS_SECRET`.

use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MdsAddress {
    /// `host:port`.
    pub host: String,
    /// The subtree a mount starts at (`/` for the whole namespace).
    pub subtree: String,
    pub secret_file: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    /// Where a decoupled mount keeps its journal under local durability.
    pub local_dir: Option<PathBuf>,
}

impl MdsAddress {
    pub fn is_address(s: &str) -> bool {
        s.starts_with("mds://")
    }

    pub fn parse(s: &str) -> Result<MdsAddress, String> {
        let rest = s
            .strip_prefix("mds://")
            .ok_or_else(|| format!("{s:?} is not an mds:// address"))?;
        let (main, query) = match rest.split_once('?') {
            Some((m, q)) => (m, Some(q)),
            None => (rest, None),
        };
        let (host, subtree) = match main.find('/') {
            Some(i) => (&main[..i], &main[i..]),
            None => (main, "/"),
        };
        if host.is_empty() || !host.contains(':') {
            return Err(format!(
                "{s:?}: the service is HOST:PORT (mds://HOST:PORT[/SUBTREE][?secret-file=PATH])"
            ));
        }
        let mut a = MdsAddress {
            host: host.to_string(),
            subtree: if subtree.is_empty() { "/" } else { subtree }.to_string(),
            secret_file: None,
            tls_ca: None,
            local_dir: None,
        };
        for kv in query.unwrap_or("").split('&').filter(|k| !k.is_empty()) {
            match kv.split_once('=') {
                Some(("secret-file", v)) => a.secret_file = Some(v.into()),
                Some(("tls-ca", v)) => a.tls_ca = Some(v.into()),
                Some(("local-dir", v)) => a.local_dir = Some(v.into()),
                _ => {
                    return Err(format!(
                        "unknown option {kv:?} in {s:?} (known: secret-file=PATH, tls-ca=PATH, local-dir=PATH)"
                    ))
                }
            }
        }
        Ok(a)
    }

    /// The shared secret: the file's first line, or the environment's.
    pub fn secret(&self) -> Result<String, String> {
        if let Some(f) = &self.secret_file {
            let t = std::fs::read_to_string(f)
                .map_err(|e| format!("reading the service's secret {}: {e}", f.display()))?;
            return Ok(t.lines().next().unwrap_or("").trim().to_string());
        }
        std::env::var("QUILTFS_MDS_SECRET").map_err(|_| {
            "no secret for the metadata service: add ?secret-file=PATH to the address or set \
             QUILTFS_MDS_SECRET"
                .to_string()
        })
    }

    /// The CA certificate to verify the service with (TLS), if the address names one.
    pub fn ca(&self) -> Result<Option<Vec<u8>>, String> {
        self.tls_ca
            .as_ref()
            .map(|p| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display())))
            .transpose()
    }

    /// The same service, with `path` as the subtree.
    pub fn with_subtree(&self, path: &str) -> MdsAddress {
        MdsAddress {
            subtree: path.to_string(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_with_and_without_a_subtree_and_options() {
        let a = MdsAddress::parse("mds://127.0.0.1:7420/jobs/a?secret-file=/tmp/s").unwrap();
        assert_eq!(a.host, "127.0.0.1:7420");
        assert_eq!(a.subtree, "/jobs/a");
        assert_eq!(a.secret_file, Some(PathBuf::from("/tmp/s")));
        let b = MdsAddress::parse("mds://host:1").unwrap();
        assert_eq!(b.subtree, "/");
        for bad in [
            "mds://",
            "mds:///x",
            "mds://host/x",
            "gnothi://a:1/v",
            "mds://h:1?x=y",
        ] {
            assert!(MdsAddress::parse(bad).is_err(), "{bad}");
        }
    }
}
