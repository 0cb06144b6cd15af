//! What every configuration section shares: the error its check returns.
//!
//! Each plane owns its section of the node's configuration (the `[router]` section is
//! `request_plane/router/config.rs`, `[worker]` is `worker/config.rs`, …) with its `Default`
//! and its own `validate`; the composition root (`node/config.rs`) holds the tree, loads it
//! and checks the rules that span sections. They all answer with [`ConfigError`], which names
//! the offending field by its dotted key path (`cluster.liveness_timeout_ms`).

use std::borrow::Cow;

/// A configuration that cannot be used, naming the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A source could not be read or parsed.
    #[error("configuration: {0}")]
    Load(Box<figment::Error>),
    /// A value is out of range or inconsistent.
    #[error("configuration: {field}: {message}")]
    Invalid {
        /// Dotted field path.
        field: Cow<'static, str>,
        /// What is wrong.
        message: String,
    },
}

impl ConfigError {
    /// [`ConfigError::Invalid`]: `field` (a dotted key path) and what is wrong with it.
    pub fn invalid(field: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The dotted key path an [`Invalid`](ConfigError::Invalid) error names (`None` for a
    /// source that could not be loaded).
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { field, .. } => Some(field),
            ConfigError::Load(_) => None,
        }
    }
}

// Not `#[from]`: that would make the figment error the source too, and error chains would
// print it twice.
impl From<Box<figment::Error>> for ConfigError {
    fn from(e: Box<figment::Error>) -> Self {
        ConfigError::Load(e)
    }
}
