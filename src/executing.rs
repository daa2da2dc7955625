//! The keys the calls of this process are executing, each with the address
//! of its connection. An operation runs on its call's connection, which no
//! other call uses meanwhile, so what runs inside an operation finds its
//! call here: a nested call on the same connection with the same key (in
//! progress), and a message enqueued through the call's connection (it
//! takes the call's scope). One list for the process, not one per thread:
//! an async call may move between threads at every `await`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Each entry: its number, its connection's address, its scope and key.
static EXECUTING: Mutex<Vec<(u64, usize, String, String)>> = Mutex::new(Vec::new());

/// The numbers that tell the entries apart.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// A key a call executes on a connection, from the hold to the commit, or
/// until its future is dropped.
pub(crate) struct Executing(u64);

impl Executing {
    /// `None` when a call already executes `(scope, key)` on `conn`.
    pub(crate) fn enter<C>(conn: &C, scope: &str, key: &str) -> Option<Executing> {
        let conn = address(conn);
        let mut executing = list();
        if executing
            .iter()
            .any(|(_, c, s, k)| *c == conn && s == scope && k == key)
        {
            return None;
        }
        let number = NEXT.fetch_add(1, Ordering::Relaxed);
        executing.push((number, conn, scope.to_owned(), key.to_owned()));
        Some(Executing(number))
    }
}

impl Drop for Executing {
    fn drop(&mut self) {
        list().retain(|(number, ..)| *number != self.0);
    }
}

/// The scope of the innermost call that executes on `conn`.
pub(crate) fn scope_on<C>(conn: &C) -> Option<String> {
    let conn = address(conn);
    list()
        .iter()
        .rev()
        .find(|(_, c, _, _)| *c == conn)
        .map(|(_, _, scope, _)| scope.clone())
}

/// The list, also after a panic elsewhere while it was held: every change
/// to it is a single push or retain, which leaves it whole.
fn list() -> std::sync::MutexGuard<'static, Vec<(u64, usize, String, String)>> {
    EXECUTING.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn address<C>(conn: &C) -> usize {
    std::ptr::from_ref(conn).addr()
}
