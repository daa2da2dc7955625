//! The keys the calls on this thread are executing, each with the address
//! of its connection. Operations run on their caller's thread, so what runs
//! inside an operation finds its call here: a nested call on the same
//! connection with the same key (in progress), and a message enqueued
//! through the call's connection (it takes the call's scope).

use std::cell::RefCell;

thread_local! {
    static EXECUTING: RefCell<Vec<(usize, String, String)>> = const { RefCell::new(Vec::new()) };
}

/// A key this thread executes on a connection, from the hold to the commit.
pub(crate) struct Executing(usize);

impl Executing {
    /// `None` when a call on this thread already executes `(scope, key)` on
    /// `conn`.
    pub(crate) fn enter<C>(conn: &C, scope: &str, key: &str) -> Option<Executing> {
        let conn = address(conn);
        EXECUTING.with_borrow_mut(|executing| {
            if executing.iter().any(|(c, s, k)| *c == conn && s == scope && k == key) {
                return None;
            }
            executing.push((conn, scope.to_owned(), key.to_owned()));
            Some(Executing(executing.len()))
        })
    }
}

impl Drop for Executing {
    fn drop(&mut self) {
        EXECUTING.with_borrow_mut(|executing| executing.truncate(self.0 - 1));
    }
}

/// The scope of the innermost call this thread executes on `conn`.
pub(crate) fn scope_on<C>(conn: &C) -> Option<String> {
    let conn = address(conn);
    EXECUTING.with_borrow(|executing| {
        executing
            .iter()
            .rev()
            .find(|(c, _, _)| *c == conn)
            .map(|(_, scope, _)| scope.clone())
    })
}

fn address<C>(conn: &C) -> usize {
    std::ptr::from_ref(conn).addr()
}
