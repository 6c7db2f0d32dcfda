//! A subtree's policy: how consistent and how durable its updates are, how many inode
//! numbers a decoupled client gets, whether others may write in it meanwhile, and how
//! often a decoupled client shows its progress.
//!
//! Consistency × durability is Cudele's table: each of the nine cells is a composition
//! of the seven mechanisms ([`Policy::mechanisms`]). The paper's named compositions are
//! [`Preset`]s.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// When other clients see a subtree's updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Consistency {
    /// Every update is seen at once: one request per operation to the service.
    Strong,
    /// Updates are merged into the global namespace later: at every namespace sync, at
    /// `quiltfs sync`, and when the client lets go of the subtree.
    Weak,
    /// The service never merges them; the application (or middleware) does, from the
    /// client's journal.
    Invisible,
}

/// Which failures a subtree's updates survive once acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Durability {
    /// Lost on any failure.
    None,
    /// Survive when the node that made them comes back and reads its local disk.
    Local,
    /// Survive the loss of the client: they are on the service's durable storage.
    Global,
}

/// Whether other clients may change a decoupled subtree while its holder works in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Interfere {
    /// Their changes are accepted; at merge the holder's updates win (`merge.rs`).
    Allow,
    /// Every request of another client inside the subtree fails with EBUSY.
    Block,
}

/// The seven mechanisms, with the paper's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mechanism {
    Rpcs,
    Stream,
    AppendClientJournal,
    VolatileApply,
    NonvolatileApply,
    LocalPersist,
    GlobalPersist,
}

impl Mechanism {
    pub const ALL: [Mechanism; 7] = [
        Mechanism::Rpcs,
        Mechanism::Stream,
        Mechanism::AppendClientJournal,
        Mechanism::VolatileApply,
        Mechanism::NonvolatileApply,
        Mechanism::LocalPersist,
        Mechanism::GlobalPersist,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Rpcs => "RPCs",
            Mechanism::Stream => "Stream",
            Mechanism::AppendClientJournal => "Append Client Journal",
            Mechanism::VolatileApply => "Volatile Apply",
            Mechanism::NonvolatileApply => "Nonvolatile Apply",
            Mechanism::LocalPersist => "Local Persist",
            Mechanism::GlobalPersist => "Global Persist",
        }
    }
}

/// A subtree's policy. The defaults are the paper's: strong consistency, global
/// durability (RPCs + Stream), 100 inode numbers, interference allowed; and a namespace
/// sync every 10 s for weak subtrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Policy {
    pub consistency: Consistency,
    pub durability: Durability,
    /// Inode numbers granted to a client that decouples the subtree; more are granted
    /// as it uses them up (each grant is one merge's worth of new files at most).
    pub inodes: u64,
    pub interfere: Interfere,
    /// How often a decoupled client of a weak subtree sends what it did since the last
    /// sync (milliseconds; 0: only at `quiltfs sync` and when it lets go).
    pub sync_interval_ms: u64,
}

impl Default for Policy {
    fn default() -> Policy {
        Preset::Posix.policy()
    }
}

/// The most inode numbers one decoupling may ask for at once.
pub const MAX_INODES: u64 = 1 << 24;

/// The paper's named compositions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    /// RPCs + Stream: strong, global.
    Posix,
    /// Append Client Journal + Volatile Apply + Global Persist: weak, global (the
    /// figure's 2.29 = 1 + 0.93 + 0.36).
    Hdfs,
    /// Append Client Journal + Local Persist + Volatile Apply: weak, local.
    BatchFs,
    /// Append Client Journal + Local Persist: invisible, local.
    DeltaFs,
    /// Append Client Journal + Volatile Apply: weak, none (memory speed, lost on a
    /// failure).
    RamDisk,
}

impl Preset {
    pub const ALL: [Preset; 5] = [
        Preset::Posix,
        Preset::Hdfs,
        Preset::BatchFs,
        Preset::DeltaFs,
        Preset::RamDisk,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Posix => "posix",
            Preset::Hdfs => "hdfs",
            Preset::BatchFs => "batchfs",
            Preset::DeltaFs => "deltafs",
            Preset::RamDisk => "ramdisk",
        }
    }

    pub fn policy(self) -> Policy {
        let (consistency, durability) = match self {
            Preset::Posix => (Consistency::Strong, Durability::Global),
            Preset::Hdfs => (Consistency::Weak, Durability::Global),
            Preset::BatchFs => (Consistency::Weak, Durability::Local),
            Preset::DeltaFs => (Consistency::Invisible, Durability::Local),
            Preset::RamDisk => (Consistency::Weak, Durability::None),
        };
        Policy {
            consistency,
            durability,
            inodes: 100,
            interfere: Interfere::Allow,
            sync_interval_ms: 10_000,
        }
    }
}

impl Policy {
    /// Whether a client that mounts the subtree works in its own journal (weak or
    /// invisible) rather than sending every operation (strong).
    pub fn decoupled(&self) -> bool {
        self.consistency != Consistency::Strong
    }

    /// The mechanisms of this cell of the table, in the order they run.
    pub fn mechanisms(&self) -> Vec<Mechanism> {
        use Mechanism::*;
        let mut m = Vec::new();
        match self.consistency {
            Consistency::Strong => m.push(Rpcs),
            _ => m.push(AppendClientJournal),
        }
        match (self.consistency, self.durability) {
            (Consistency::Strong, Durability::Global) => m.push(Stream),
            (_, Durability::Local) => m.push(LocalPersist),
            (c, Durability::Global) if c != Consistency::Strong => m.push(GlobalPersist),
            _ => {}
        }
        if self.consistency == Consistency::Weak {
            m.push(VolatileApply);
        }
        m
    }

    /// The composition's formula, as the paper writes it ("append client journal +
    /// local persist").
    pub fn formula(&self) -> String {
        self.mechanisms()
            .iter()
            .map(|m| m.name().to_lowercase())
            .collect::<Vec<_>>()
            .join(" + ")
    }

    /// Changes one setting from `key=value` (the words of `quiltfs mds policy set`):
    /// `consistency=strong|weak|invisible`, `durability=none|local|global`,
    /// `inodes=N`, `interfere=allow|block`, `sync=SECONDS` (or `sync=MSms`), and
    /// `preset=NAME` (which sets consistency and durability).
    pub fn set(&mut self, setting: &str) -> Result<(), PolicyError> {
        let (key, value) = setting
            .split_once('=')
            .ok_or_else(|| PolicyError::Syntax(setting.to_string()))?;
        let bad = || PolicyError::Value {
            key: key.to_string(),
            value: value.to_string(),
        };
        match key {
            "consistency" => {
                self.consistency = match value {
                    "strong" => Consistency::Strong,
                    "weak" => Consistency::Weak,
                    "invisible" => Consistency::Invisible,
                    _ => return Err(bad()),
                }
            }
            "durability" => {
                self.durability = match value {
                    "none" => Durability::None,
                    "local" => Durability::Local,
                    "global" => Durability::Global,
                    _ => return Err(bad()),
                }
            }
            "interfere" => {
                self.interfere = match value {
                    "allow" => Interfere::Allow,
                    "block" => Interfere::Block,
                    _ => return Err(bad()),
                }
            }
            "inodes" => {
                let n: u64 = value.parse().map_err(|_| bad())?;
                if n == 0 || n > MAX_INODES {
                    return Err(bad());
                }
                self.inodes = n;
            }
            "sync" => {
                self.sync_interval_ms = match value.strip_suffix("ms") {
                    Some(ms) => ms.parse().map_err(|_| bad())?,
                    None => {
                        let s: f64 = value.trim_end_matches('s').parse().map_err(|_| bad())?;
                        if !(0.0..=86_400.0).contains(&s) {
                            return Err(bad());
                        }
                        (s * 1000.0).round() as u64
                    }
                }
            }
            "preset" => {
                let p = Preset::ALL
                    .into_iter()
                    .find(|p| p.name() == value)
                    .ok_or_else(bad)?;
                let q = p.policy();
                self.consistency = q.consistency;
                self.durability = q.durability;
            }
            _ => return Err(PolicyError::Key(key.to_string())),
        }
        Ok(())
    }
}

impl fmt::Display for Consistency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Consistency::Strong => "strong",
            Consistency::Weak => "weak",
            Consistency::Invisible => "invisible",
        })
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Durability::None => "none",
            Durability::Local => "local",
            Durability::Global => "global",
        })
    }
}

impl fmt::Display for Interfere {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Interfere::Allow => "allow",
            Interfere::Block => "block",
        })
    }
}

impl fmt::Display for Policy {
    /// The words `Policy::set` takes back, one per setting.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "consistency={} durability={} inodes={} interfere={} sync={}ms",
            self.consistency, self.durability, self.inodes, self.interfere, self.sync_interval_ms
        )
    }
}

impl FromStr for Policy {
    type Err = PolicyError;

    /// Settings separated by spaces or commas, applied over the default.
    fn from_str(s: &str) -> Result<Policy, PolicyError> {
        let mut p = Policy::default();
        for word in s.split([' ', ',', '\n']).filter(|w| !w.is_empty()) {
            p.set(word)?;
        }
        Ok(p)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("`{0}` is not a setting: write KEY=VALUE")]
    Syntax(String),
    #[error(
        "`{0}` is not a policy setting (consistency, durability, inodes, interfere, sync, \
         preset)"
    )]
    Key(String),
    #[error("`{value}` is not a value of {key}")]
    Value { key: String, value: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cell_of_the_table_composes_the_papers_mechanisms() {
        use Mechanism::*;
        let cell = |c, d| {
            Policy {
                consistency: c,
                durability: d,
                ..Policy::default()
            }
            .mechanisms()
        };
        use Consistency as C;
        use Durability as D;
        assert_eq!(cell(C::Invisible, D::None), vec![AppendClientJournal]);
        assert_eq!(
            cell(C::Weak, D::None),
            vec![AppendClientJournal, VolatileApply]
        );
        assert_eq!(cell(C::Strong, D::None), vec![Rpcs]);
        assert_eq!(
            cell(C::Invisible, D::Local),
            vec![AppendClientJournal, LocalPersist]
        );
        assert_eq!(
            cell(C::Weak, D::Local),
            vec![AppendClientJournal, LocalPersist, VolatileApply]
        );
        assert_eq!(cell(C::Strong, D::Local), vec![Rpcs, LocalPersist]);
        assert_eq!(
            cell(C::Invisible, D::Global),
            vec![AppendClientJournal, GlobalPersist]
        );
        assert_eq!(
            cell(C::Weak, D::Global),
            vec![AppendClientJournal, GlobalPersist, VolatileApply]
        );
        assert_eq!(cell(C::Strong, D::Global), vec![Rpcs, Stream]);
    }

    #[test]
    fn presets_are_the_papers_compositions() {
        assert_eq!(Preset::Posix.policy().formula(), "rpcs + stream");
        assert_eq!(
            Preset::DeltaFs.policy().formula(),
            "append client journal + local persist"
        );
        assert_eq!(
            Preset::Hdfs.policy().formula(),
            "append client journal + global persist + volatile apply"
        );
        assert!(!Preset::Posix.policy().decoupled());
        assert!(Preset::BatchFs.policy().decoupled());
    }

    #[test]
    fn settings_parse_print_and_parse_back() {
        let p: Policy = "consistency=weak durability=local inodes=5000 interfere=block sync=2.5"
            .parse()
            .unwrap();
        assert_eq!(p.consistency, Consistency::Weak);
        assert_eq!(p.durability, Durability::Local);
        assert_eq!(p.inodes, 5000);
        assert_eq!(p.interfere, Interfere::Block);
        assert_eq!(p.sync_interval_ms, 2500);
        assert_eq!(p.to_string().parse::<Policy>().unwrap(), p);
        let q: Policy = "preset=deltafs,sync=0".parse().unwrap();
        assert_eq!(q.consistency, Consistency::Invisible);
        assert_eq!(q.sync_interval_ms, 0);
    }

    #[test]
    fn bad_settings_say_what_is_wrong() {
        for (s, want) in [
            ("consistency", "not a setting"),
            ("colour=red", "not a policy setting"),
            ("consistency=eventual", "not a value of consistency"),
            ("inodes=0", "not a value of inodes"),
            ("inodes=-3", "not a value of inodes"),
            ("sync=-1", "not a value of sync"),
            ("preset=nfs", "not a value of preset"),
        ] {
            let e = s.parse::<Policy>().unwrap_err().to_string();
            assert!(e.contains(want), "{s}: {e}");
        }
    }
}
