//! The cause an I/O failure keeps as it crosses the module boundary.
//!
//! A module turns the device's, the patch layer's or the tree's error into an
//! [`FsError::Io`](crate::FsError::Io) for its callers. Flattening it to a string there lost
//! what a program (or a retry policy over a replicated device) needs: the `io::Error`'s
//! kind, whether the device was only unavailable, which block. [`IoError`] keeps that
//! error as its `source()`, and its message for display and the wire.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

/// The message of an I/O failure, and the error that caused it where there is one.
///
/// Two `IoError`s are equal when their messages are: a cause is not comparable in
/// general, and an error that crossed a process boundary ([`crate::WireError`]) has only
/// its message left.
#[derive(Clone)]
pub struct IoError {
    message: String,
    cause: Option<Arc<dyn StdError + Send + Sync + 'static>>,
}

impl IoError {
    /// A failure with no error behind it (an errno, a message from elsewhere).
    pub fn msg(message: impl Into<String>) -> IoError {
        IoError {
            message: message.into(),
            cause: None,
        }
    }

    /// A failure caused by `cause`, shown as that error is.
    pub fn caused_by<E: StdError + Send + Sync + 'static>(cause: E) -> IoError {
        IoError {
            message: cause.to_string(),
            cause: Some(Arc::new(cause)),
        }
    }

    /// A failure caused by `cause`, shown as `context: cause`.
    pub fn context<E: StdError + Send + Sync + 'static>(context: &str, cause: E) -> IoError {
        IoError {
            message: format!("{context}: {cause}"),
            cause: Some(Arc::new(cause)),
        }
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The error that caused this one, to downcast (`quilt_block::BlockError`,
    /// `std::io::Error`, ...); `None` for a failure known only by its message.
    pub fn cause(&self) -> Option<&(dyn StdError + Send + Sync + 'static)> {
        self.cause.as_deref()
    }

    /// The first error of type `E` in the chain of causes.
    pub fn find<E: StdError + 'static>(&self) -> Option<&E> {
        let mut next: Option<&(dyn StdError + 'static)> = self.cause.as_deref().map(|c| c as _);
        while let Some(e) = next {
            if let Some(found) = e.downcast_ref::<E>() {
                return Some(found);
            }
            next = e.source();
        }
        None
    }

    /// The kind of the `std::io::Error` at the root of the failure, if one is there.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        self.find::<std::io::Error>().map(std::io::Error::kind)
    }
}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("IoError");
        d.field("message", &self.message);
        if let Some(c) = &self.cause {
            d.field("cause", c);
        }
        d.finish()
    }
}

impl PartialEq for IoError {
    fn eq(&self, other: &IoError) -> bool {
        self.message == other.message
    }
}

impl Eq for IoError {}

impl StdError for IoError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause.as_deref().map(|c| c as _)
    }
}

impl From<&str> for IoError {
    fn from(m: &str) -> IoError {
        IoError::msg(m)
    }
}

impl From<String> for IoError {
    fn from(m: String) -> IoError {
        IoError::msg(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("device failed at block {block}")]
    struct Outer {
        block: u64,
        #[source]
        io: std::io::Error,
    }

    #[test]
    fn the_cause_survives_and_is_found_through_the_chain() {
        let e = IoError::context(
            "reading the superblock",
            Outer {
                block: 1,
                io: std::io::Error::new(std::io::ErrorKind::TimedOut, "peer gone"),
            },
        );
        assert_eq!(
            e.to_string(),
            "reading the superblock: device failed at block 1"
        );
        assert_eq!(e.find::<Outer>().map(|o| o.block), Some(1));
        assert_eq!(e.io_kind(), Some(std::io::ErrorKind::TimedOut));
        assert!(StdError::source(&e).is_some());
        let plain = IoError::msg("EIO");
        assert!(plain.cause().is_none() && plain.io_kind().is_none());
    }

    #[test]
    fn equality_is_by_message_so_a_wire_copy_equals_its_original() {
        let a = IoError::caused_by(std::io::Error::other("disk gone"));
        let b = IoError::msg("disk gone");
        assert_eq!(a, b);
        assert_ne!(a, IoError::msg("disk went"));
    }
}
