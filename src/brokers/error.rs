//! Why a consumer stopped, or a publisher could not be set up.

use std::fmt;

/// Why a consumer stopped, or a publisher could not be set up.
#[derive(Debug)]
pub struct Error {
    context: &'static str,
    pub(super) source: Box<dyn std::error::Error + Send + Sync>,
}

impl Error {
    pub(crate) fn new(context: &'static str, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error {
            context,
            source: source.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.context)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}
