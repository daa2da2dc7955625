//! The pools `http::run` checks connections out of: r2d2's, and with the
//! feature `deadpool` deadpool-diesel's, as axum's own diesel example uses.

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};

use self::sealed::{Call, Checkout, Unavailable};
use crate::StoreConnection;

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
        /// Runs `call` with a connection of the pool on a thread where it
        /// may block; the blocking work goes on when the returned future is
        /// dropped. (The pool is a handle; a clone is what the future
        /// keeps.)
        fn with_connection<T: Send + 'static>(
            self,
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
    async fn with_connection<T: Send + 'static>(self, call: Call<C, T>) -> Result<T, Unavailable> {
        // r2d2 waits for a connection by blocking, so the checkout joins the
        // call on the blocking thread.
        let task = tokio::task::spawn_blocking(move || {
            let mut conn = self.get().map_err(|error| Unavailable::Checkout(Box::new(error)))?;
            Ok(call(&mut conn))
        });
        task.await
            .unwrap_or_else(|error| Err(Unavailable::Aborted(Box::new(error))))
    }
}

#[cfg(feature = "deadpool")]
mod deadpool_diesel_pool {
    use deadpool::managed::Object;
    use deadpool_diesel::{Manager, Pool};
    use diesel::connection::{AnsiTransactionManager, TransactionManager};

    use super::{Call, Checkout, ConnectionPool, Unavailable};
    use crate::StoreConnection;

    /// How long a checkout from a pool without a wait timeout may wait: the
    /// default in-flight wait, the wait of a web request.
    const UNTIMED_POOL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

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
        async fn with_connection<T: Send + 'static>(self, call: Call<C, T>) -> Result<T, Unavailable> {
            // deadpool waits for ever without a wait timeout; a web request
            // must be told to retry instead.
            let checkout = match self.timeouts().wait {
                Some(_) => self.get().await,
                None => match tokio::time::timeout(UNTIMED_POOL_WAIT, self.get()).await {
                    Ok(checkout) => checkout,
                    Err(_) => {
                        let waited = format!(
                            "no connection within {} s from a pool without a wait timeout",
                            UNTIMED_POOL_WAIT.as_secs()
                        );
                        return Err(Unavailable::Checkout(waited.into()));
                    }
                },
            };
            let object = checkout.map_err(|error| Unavailable::Checkout(Box::new(error)))?;
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
