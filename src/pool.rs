//! The pools of diesel-async connections that the async entry points
//! check a connection out of (`http::run_async`,
//! [`Relay::serve_async`](crate::outbox::Relay::serve_async)): bb8's and
//! deadpool's, both through diesel-async's `AsyncDieselConnectionManager`.

use std::error::Error as StdError;
use std::ops::{Deref, DerefMut};

use diesel_async::pooled_connection::{AsyncDieselConnectionManager, PoolError, PoolableConnection, bb8, deadpool};

use self::sealed::Lend;
use crate::AsyncStoreConnection;
use crate::checkout::checkout;

/// A pool of diesel-async connections that the async entry points take a
/// connection from (`http::run_async` and `http::run_phased_async`,
/// [`Relay::serve_async`](crate::outbox::Relay::serve_async)):
/// `diesel_async::pooled_connection::bb8::Pool<C>` or
/// `diesel_async::pooled_connection::deadpool::Pool<C>`, for every `C` that
/// is an [`AsyncStoreConnection`]. Sealed: only the crate implements it.
///
/// A checkout waits for the pool's timeout: bb8's `connection_timeout` (30
/// s unless set), deadpool's `wait` timeout, and for a deadpool pool
/// without one, which would wait for ever, 5 s. An HTTP request that gets
/// no connection within it is a 503 with `Retry-After`; a relay counts it
/// as an error and tries again.
///
/// A connection whose call's future was dropped inside its transaction
/// (the client hung up) never goes back to the pool: bb8 drops it as it
/// comes back, and the crate takes it out of a deadpool pool at once, which
/// closes it, so the server rolls its transaction back and frees the key.
pub trait AsyncConnectionPool: Send + Sync + Lend<Self::Connection> {
    /// The diesel-async connection the pool hands out.
    type Connection: AsyncStoreConnection + PoolableConnection + 'static;
}

/// What the crate asks of an async pool. Public in a module no other
/// crate can name: `AsyncConnectionPool` is sealed by it.
pub(crate) mod sealed {
    use std::error::Error as StdError;
    use std::future::Future;
    use std::ops::DerefMut;

    /// Lending a connection `C` for one call.
    pub trait Lend<C> {
        /// A connection lent by the pool, back to it when dropped.
        type Lent<'p>: DerefMut<Target = C> + Send
        where
            Self: 'p;

        /// A connection of the pool, or the pool's reason for none.
        fn lend(&self) -> impl Future<Output = Result<Self::Lent<'_>, Box<dyn StdError + Send + Sync>>> + Send;

        /// A new connection made by the pool's manager, outside the pool:
        /// for a service that keeps one as long as it runs.
        fn dedicated(&self) -> impl Future<Output = Result<C, Box<dyn StdError + Send + Sync>>> + Send;
    }
}

impl<C> AsyncConnectionPool for bb8::Pool<C>
where
    C: AsyncStoreConnection + PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::bb8::ManageConnection<Connection = C, Error = PoolError>,
{
    type Connection = C;
}

impl<C> Lend<C> for bb8::Pool<C>
where
    C: AsyncStoreConnection + PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::bb8::ManageConnection<Connection = C, Error = PoolError>,
{
    type Lent<'p> = bb8::PooledConnection<'p, C>;

    async fn lend(&self) -> Result<Self::Lent<'_>, Box<dyn StdError + Send + Sync>> {
        self.get()
            .await
            .map_err(|error| Box::new(error) as Box<dyn StdError + Send + Sync>)
    }

    async fn dedicated(&self) -> Result<C, Box<dyn StdError + Send + Sync>> {
        self.dedicated_connection()
            .await
            .map_err(|error| Box::new(error) as Box<dyn StdError + Send + Sync>)
    }
}

impl<C> AsyncConnectionPool for deadpool::Pool<C>
where
    C: AsyncStoreConnection + PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::deadpool::managed::Manager<Type = C, Error = PoolError>,
{
    type Connection = C;
}

impl<C> Lend<C> for deadpool::Pool<C>
where
    C: AsyncStoreConnection + PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::deadpool::managed::Manager<Type = C, Error = PoolError>,
{
    type Lent<'p> = Discarded<C>;

    async fn lend(&self) -> Result<Discarded<C>, Box<dyn StdError + Send + Sync>> {
        Ok(Discarded(Some(checkout(self).await?)))
    }

    async fn dedicated(&self) -> Result<C, Box<dyn StdError + Send + Sync>> {
        ::deadpool::managed::Manager::create(self.manager())
            .await
            .map_err(|error| Box::new(error) as Box<dyn StdError + Send + Sync>)
    }
}

/// A connection lent by a deadpool pool, taken out of the pool when it
/// comes back broken. deadpool looks at a connection only when it lends it
/// again, so one left inside a transaction would sit in the pool holding
/// its key's lock until then.
pub struct Discarded<C>(Option<deadpool::Object<C>>)
where
    C: PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::deadpool::managed::Manager<Type = C, Error = PoolError>;

impl<C> Deref for Discarded<C>
where
    C: PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::deadpool::managed::Manager<Type = C, Error = PoolError>,
{
    type Target = C;
    fn deref(&self) -> &C {
        self.0.as_deref().expect("present until dropped")
    }
}

impl<C> DerefMut for Discarded<C>
where
    C: PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::deadpool::managed::Manager<Type = C, Error = PoolError>,
{
    fn deref_mut(&mut self) -> &mut C {
        self.0.as_deref_mut().expect("present until dropped")
    }
}

impl<C> Drop for Discarded<C>
where
    C: PoolableConnection + 'static,
    AsyncDieselConnectionManager<C>: ::deadpool::managed::Manager<Type = C, Error = PoolError>,
{
    fn drop(&mut self) {
        if let Some(mut object) = self.0.take()
            && object.is_broken()
        {
            drop(deadpool::Object::take(object));
        }
    }
}
