//! The pools `http::run` checks connections out of: r2d2's, and with the
//! feature `deadpool` deadpool-diesel's, as axum's own diesel example uses.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use diesel::r2d2::{ConnectionManager, Pool, PooledConnection, R2D2Connection};
use tokio::sync::oneshot::{self, error::TryRecvError};

use self::sealed::{Call, Checkout, Unavailable};
use crate::StoreConnection;
use crate::telemetry::TARGET;

/// How long an r2d2 checkout waits at a time before it looks whether the
/// request's client is still there: how long an abandoned request may
/// still wait for a connection.
const CHECKOUT_SLICE: Duration = Duration::from_millis(100);

/// A pool of diesel connections that [`run`](super::run) and
/// [`run_phased`](super::run_phased) take a connection from:
/// `r2d2::Pool<ConnectionManager<C>>` (diesel's own), or, with the feature
/// `deadpool`, `deadpool_diesel::Pool<deadpool_diesel::Manager<C>>`. Either
/// way the connection is used on tokio's blocking pool, never on an async
/// worker. Sealed: only the crate implements it.
///
/// A request that gets no connection within the pool's timeout is a 503
/// with `Retry-After`: r2d2's `connection_timeout` (30 s unless set),
/// deadpool's `wait` timeout, and for a deadpool pool without one, which
/// would wait for ever, 5 s.
///
/// A request whose client hangs up while it waits for a connection gives
/// up its wait: it runs nothing, and a connection that came as the client
/// went goes back to the pool unused, so abandoned requests build no
/// backlog in front of the clients still there (on axum, which drops the
/// handler of a client that hung up; actix-web lets it run, see
/// [HTTP with actix-web](crate::guide::actix#a-client-that-hangs-up)). deadpool waits on the handler's own future, which the server
/// drops; r2d2 waits on a blocking thread, which looks whether the client
/// is still there every 100 ms and gives up then. (An r2d2 event handler
/// sees a timeout event for each of these waits that ran out.) Once a connection is checked out, the call
/// runs to its end whatever the client does.
pub trait ConnectionPool: Clone + Send + Sync + 'static + Checkout<Self::Connection> {
    /// The diesel connection the pool hands out.
    type Connection: StoreConnection<Raw = Self::Connection> + Send + 'static;
}

/// What the HTTP layer asks of a pool. Public in a module no other crate
/// can name: `ConnectionPool` is sealed by it, and none of this is part of
/// the crate's API.
pub(super) mod sealed {
    use std::error::Error as StdError;
    use std::future::Future;

    /// A call to make with a connection `C`, returning `T`.
    ///
    /// Boxed so that the future of a checkout names no closure type, and so
    /// no lifetime of the handler that made it: an axum handler's future
    /// must be `Send` for every such lifetime.
    pub type Call<C, T> = Box<dyn FnOnce(&mut C) -> T + Send>;

    /// Why a pool ran no call.
    #[derive(Debug)]
    pub enum Unavailable {
        /// No connection in time: the pool's own error.
        Checkout(Box<dyn StdError + Send + Sync>),
        /// The call panicked, or the runtime stopped before it ran.
        Aborted(Box<dyn StdError + Send + Sync>),
    }

    /// Checking out a connection `C` for one call.
    pub trait Checkout<C> {
        /// Runs `call` for a request of `scope` with a connection of the
        /// pool on a thread where it may block. Dropped before the
        /// connection is checked out, the returned future takes the wait
        /// for one with it: `call` is dropped unmade. Dropped after, the
        /// blocking work goes on. (The pool is a handle; a clone is what
        /// the future keeps.)
        fn with_connection<T: Send + 'static>(
            self,
            scope: String,
            call: Call<C, T>,
        ) -> impl Future<Output = Result<T, Unavailable>> + Send;
    }
}

impl<C> ConnectionPool for Pool<ConnectionManager<C>>
where
    C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
{
    type Connection = C;
}

impl<C> Checkout<C> for Pool<ConnectionManager<C>>
where
    C: StoreConnection<Raw = C> + R2D2Connection + Send + 'static,
{
    async fn with_connection<T: Send + 'static>(self, scope: String, call: Call<C, T>) -> Result<T, Unavailable> {
        // r2d2 waits for a connection by blocking, so the checkout joins the
        // call on the blocking thread; `waiting` goes with this future, and
        // tells the thread that no one waits for the answer any more.
        let (waiting, client) = oneshot::channel::<Infallible>();
        let task = tokio::task::spawn_blocking(move || {
            let mut conn = checkout(&self, client, &scope)?;
            Ok(call(&mut conn))
        });
        let joined = task.await;
        drop(waiting);
        joined.unwrap_or_else(|error| Err(Unavailable::Aborted(Box::new(error))))
    }
}

/// A connection of `pool` within its connection timeout, waited for in
/// slices of [`CHECKOUT_SLICE`], while `client` shows that the request's
/// client is there; none once it is gone, not even one that came as it
/// went.
fn checkout<C>(
    pool: &Pool<ConnectionManager<C>>,
    mut client: oneshot::Receiver<Infallible>,
    scope: &str,
) -> Result<PooledConnection<ConnectionManager<C>>, Unavailable>
where
    C: R2D2Connection + Send + 'static,
{
    let deadline = Instant::now() + pool.connection_timeout();
    let mut gone = || {
        let gone = matches!(client.try_recv(), Err(TryRecvError::Closed));
        if gone {
            tracing::debug!(target: TARGET, scope, "the client is gone before its request got a connection: it runs nothing");
        }
        gone
    };
    loop {
        if gone() {
            return Err(Unavailable::Checkout("the client is gone".into()));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match pool.get_timeout(left.min(CHECKOUT_SLICE)) {
            // Gone while the connection came: back to the pool unused.
            Ok(_) if gone() => return Err(Unavailable::Checkout("the client is gone".into())),
            Ok(conn) => return Ok(conn),
            Err(error) if left <= CHECKOUT_SLICE => return Err(Unavailable::Checkout(Box::new(error))),
            Err(_) => {}
        }
    }
}

#[cfg(feature = "deadpool")]
mod deadpool_diesel_pool {
    use deadpool::managed::Object;
    use deadpool_diesel::{Manager, Pool};
    use diesel::connection::{AnsiTransactionManager, TransactionManager};

    use super::{Call, Checkout, ConnectionPool, Unavailable};
    use crate::StoreConnection;
    use crate::checkout::checkout;

    impl<C> ConnectionPool for Pool<Manager<C>>
    where
        C: StoreConnection<Raw = C> + diesel::Connection<TransactionManager = AnsiTransactionManager> + Send + 'static,
        Manager<C>: deadpool::managed::Manager<Type = deadpool_diesel::Connection<C>, Error = deadpool_diesel::Error>,
    {
        type Connection = C;
    }

    impl<C> Checkout<C> for Pool<Manager<C>>
    where
        C: StoreConnection<Raw = C> + diesel::Connection<TransactionManager = AnsiTransactionManager> + Send + 'static,
        Manager<C>: deadpool::managed::Manager<Type = deadpool_diesel::Connection<C>, Error = deadpool_diesel::Error>,
    {
        async fn with_connection<T: Send + 'static>(self, _scope: String, call: Call<C, T>) -> Result<T, Unavailable> {
            let object = checkout(&self).await.map_err(Unavailable::Checkout)?;
            let (result, broken) = object
                .interact(move |conn| {
                    let result = call(conn);
                    (result, AnsiTransactionManager::is_broken_transaction_manager(conn))
                })
                .await
                .map_err(|error| Unavailable::Aborted(error.to_string().into()))?;
            // deadpool-diesel's default recycling does not look at the
            // transaction manager: a connection that can run no more
            // transactions leaves the pool here, as r2d2 discards it.
            if broken {
                drop(Object::take(object));
            }
            Ok(result)
        }
    }
}
