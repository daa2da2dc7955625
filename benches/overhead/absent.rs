//! The stand-in for each backend not compiled in. `db::Statement` asks
//! every statement to be executable on all three backends, since a scenario
//! generic over the connection cannot name the one it runs on; a backend
//! that is not built has no connection to check against, so every
//! statement counts as executable on it.

/// Any statement at all.
pub trait Executable {}

impl<S> Executable for S {}
