//! How a statement built with diesel's DSL is sent on either kind of
//! connection: at once on a synchronous one, awaited on a diesel-async one.
//!
//! The statements are plain functions that build a query (`keys/statements.rs`,
//! say), and the code that sends them is written once, generic over the
//! connection: `Execute::send` and `Load::fetch` pick diesel's or
//! diesel-async's way to run a query by the connection's `Sends::Way`.
//! MySQL's key statements, which are its own, go through its `Session`,
//! which returns a [`Sent`] as well.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use diesel::QueryResult;

/// A connection the crate sends statements on, and how it sends them:
/// [`AtOnce`] or `Awaited`.
pub(crate) trait Sends {
    /// How the connection runs a query.
    type Way;
}

/// A synchronous diesel connection's way: a statement completes as it is
/// sent.
pub(crate) enum AtOnce {}

/// A diesel-async connection's way: a statement is awaited.
#[cfg(feature = "diesel-async")]
pub(crate) enum Awaited {}

/// A statement sent, as a future of its result: complete on a synchronous
/// connection, diesel-async's future on an async one.
///
/// A type of its own rather than an `impl Future`: whether an opaque future
/// is `Send` is proved from the bounds of the code that made it, and the
/// compiler cannot prove diesel's bounds on a query that borrows for every
/// lifetime, so an application could not spawn a call that awaits one.
pub(crate) enum Sent<'c, T> {
    /// The result of a statement that completed as it was sent.
    Done(Option<QueryResult<T>>),
    /// A statement diesel-async sends.
    #[cfg(feature = "diesel-async")]
    Awaited(Pin<Box<dyn Future<Output = QueryResult<T>> + Send + 'c>>),
    #[cfg(not(feature = "diesel-async"))]
    #[expect(dead_code, reason = "only the lifetime that an awaited statement borrows for")]
    Never(std::marker::PhantomData<&'c ()>, std::convert::Infallible),
}

// Nothing in it is pinned: the boxed future is pinned in its box.
impl<T> Unpin for Sent<'_, T> {}

impl<T> Future for Sent<'_, T> {
    type Output = QueryResult<T>;

    #[cfg_attr(not(feature = "diesel-async"), expect(unused_variables, reason = "nothing waits"))]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<QueryResult<T>> {
        match self.get_mut() {
            Sent::Done(result) => Poll::Ready(result.take().expect("a statement's result is taken once")),
            #[cfg(feature = "diesel-async")]
            Sent::Awaited(future) => future.as_mut().poll(cx),
            #[cfg(not(feature = "diesel-async"))]
            Sent::Never(_, never) => match *never {},
        }
    }
}

/// The one row `rows` holds: a query's first, `NotFound` without one.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn first<U>(rows: Vec<U>) -> QueryResult<U> {
    rows.into_iter().next().ok_or(diesel::result::Error::NotFound)
}

/// A statement that connection `C` sends, returning the number of rows it
/// changed.
pub(crate) trait Execute<C>: Sized {
    /// Sends the statement on `conn`.
    fn send<'c>(self, conn: &'c mut C) -> Sent<'c, usize>
    where
        Self: 'c;
}

impl<C: Sends, Q: ExecuteBy<C, C::Way>> Execute<C> for Q {
    fn send<'c>(self, conn: &'c mut C) -> Sent<'c, usize>
    where
        Self: 'c,
    {
        self.execute_by(conn)
    }
}

/// A query that borrows for `'q` and that connection `C` sends, returning
/// rows as `U`s.
pub(crate) trait Load<'q, C, U>: Sized {
    /// Sends the query on `conn` and returns its row: `NotFound` without
    /// one.
    fn fetch<'c>(self, conn: &'c mut C) -> Sent<'c, U>
    where
        'q: 'c;

    /// Sends the query on `conn` and returns its rows.
    fn fetch_all<'c>(self, conn: &'c mut C) -> Sent<'c, Vec<U>>
    where
        'q: 'c;
}

impl<'q, C: Sends, Q: LoadBy<'q, C, U, C::Way>, U> Load<'q, C, U> for Q {
    fn fetch<'c>(self, conn: &'c mut C) -> Sent<'c, U>
    where
        'q: 'c,
    {
        self.load_by(conn)
    }

    fn fetch_all<'c>(self, conn: &'c mut C) -> Sent<'c, Vec<U>>
    where
        'q: 'c,
    {
        self.load_all_by(conn)
    }
}

/// [`Execute`] in the way `Way`.
pub(crate) trait ExecuteBy<C, Way>: Sized {
    fn execute_by<'c>(self, conn: &'c mut C) -> Sent<'c, usize>
    where
        Self: 'c;
}

impl<C, Q> ExecuteBy<C, AtOnce> for Q
where
    C: diesel::Connection,
    Q: diesel::query_dsl::methods::ExecuteDsl<C>,
{
    fn execute_by<'c>(self, conn: &'c mut C) -> Sent<'c, usize>
    where
        Self: 'c,
    {
        Sent::Done(Some(diesel::query_dsl::methods::ExecuteDsl::execute(self, conn)))
    }
}

#[cfg(feature = "diesel-async")]
impl<C, Q> ExecuteBy<C, Awaited> for Q
where
    C: diesel_async::AsyncConnection,
    Q: diesel_async::methods::ExecuteDsl<C>,
{
    fn execute_by<'c>(self, conn: &'c mut C) -> Sent<'c, usize>
    where
        Self: 'c,
    {
        Sent::Awaited(Box::pin(diesel_async::methods::ExecuteDsl::execute(self, conn)))
    }
}

/// [`Load`] in the way `Way`.
pub(crate) trait LoadBy<'q, C, U, Way>: Sized {
    fn load_by<'c>(self, conn: &'c mut C) -> Sent<'c, U>
    where
        'q: 'c;

    fn load_all_by<'c>(self, conn: &'c mut C) -> Sent<'c, Vec<U>>
    where
        'q: 'c;
}

impl<'q, C, Q, U> LoadBy<'q, C, U, AtOnce> for Q
where
    C: diesel::connection::LoadConnection,
    Q: diesel::RunQueryDsl<C> + diesel::query_dsl::LoadQuery<'q, C, U>,
{
    fn load_by<'c>(self, conn: &'c mut C) -> Sent<'c, U>
    where
        'q: 'c,
    {
        Sent::Done(Some(diesel::RunQueryDsl::get_result(self, conn)))
    }

    fn load_all_by<'c>(self, conn: &'c mut C) -> Sent<'c, Vec<U>>
    where
        'q: 'c,
    {
        Sent::Done(Some(diesel::RunQueryDsl::load(self, conn)))
    }
}

#[cfg(feature = "diesel-async")]
impl<'q, C, Q, U> LoadBy<'q, C, U, Awaited> for Q
where
    C: diesel_async::AsyncConnection,
    Q: diesel_async::RunQueryDsl<C> + diesel_async::methods::LoadQuery<'q, C, U> + 'q,
    U: Send + 'static,
{
    fn load_by<'c>(self, conn: &'c mut C) -> Sent<'c, U>
    where
        'q: 'c,
    {
        Sent::Awaited(Box::pin(diesel_async::RunQueryDsl::get_result(self, conn)))
    }

    fn load_all_by<'c>(self, conn: &'c mut C) -> Sent<'c, Vec<U>>
    where
        'q: 'c,
    {
        Sent::Awaited(Box::pin(diesel_async::RunQueryDsl::load(self, conn)))
    }
}
