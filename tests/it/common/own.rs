//! What a test owns on a server: a schema or a database of its own, under a
//! name no other test uses, dropped however the test ends.

use std::sync::atomic::{AtomicU64, Ordering};

use diesel::Connection;

/// A name no other test, in this process or another, is using.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The url of `base_url`'s database with `schema` first on the search path
/// of every session: a schema of a test's own on PostgreSQL.
pub fn url_with_search_path(base_url: &str, schema: &str) -> String {
    let separator = if base_url.contains('?') { '&' } else { '?' };
    format!("{base_url}{separator}options=-csearch_path%3D{schema}")
}

/// Runs `statement` on a connection of its own to the server at `url`.
fn execute_at<C: Connection>(url: &str, statement: &str) -> Result<(), String> {
    let mut conn = C::establish(url).map_err(|error| format!("connect to {url}: {error}"))?;
    conn.batch_execute(statement)
        .map_err(|error| format!("{statement}: {error}"))
}

/// A schema or a database of a test's own on a server: made by a statement
/// on the server, and dropped by another when this is dropped, however the
/// test ends.
pub struct OnServer {
    server: String,
    drop: String,
    execute: fn(&str, &str) -> Result<(), String>,
}

impl OnServer {
    /// Runs `create` on the server at `server` (a connection of backend
    /// `C`), and `drop` there once this is dropped.
    pub fn create<C: Connection>(server: &str, create: &str, drop: String) -> OnServer {
        execute_at::<C>(server, create).unwrap_or_else(|error| panic!("make the test's database: {error}"));
        OnServer {
            server: server.to_owned(),
            drop,
            execute: execute_at::<C>,
        }
    }
}

impl Drop for OnServer {
    fn drop(&mut self) {
        let _ = (self.execute)(&self.server, &self.drop);
    }
}
