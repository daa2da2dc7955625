//! A checkout from a deadpool pool, bounded where the pool sets no bound:
//! deadpool waits for ever without a wait timeout, and a web request must
//! be told to retry instead.

use std::error::Error as StdError;
use std::time::Duration;

use deadpool::managed::{Manager, Object, Pool};

/// How long a checkout from a deadpool pool without a wait timeout may
/// wait: the default in-flight wait, the wait of a web request.
const UNTIMED_POOL_WAIT: Duration = Duration::from_secs(5);

/// A connection of `pool`, waiting as long as its wait timeout allows, or
/// [`UNTIMED_POOL_WAIT`] where it has none; the pool's reason otherwise.
pub(crate) async fn checkout<M>(pool: &Pool<M>) -> Result<Object<M>, Box<dyn StdError + Send + Sync>>
where
    M: Manager,
    M::Error: StdError + Send + Sync + 'static,
{
    let checkout = match pool.timeouts().wait {
        Some(_) => pool.get().await,
        None => match tokio::time::timeout(UNTIMED_POOL_WAIT, pool.get()).await {
            Ok(checkout) => checkout,
            Err(_) => {
                let waited = format!(
                    "no connection within {} s from a pool without a wait timeout",
                    UNTIMED_POOL_WAIT.as_secs()
                );
                return Err(waited.into());
            }
        },
    };
    checkout.map_err(|error| Box::new(error) as Box<dyn StdError + Send + Sync>)
}
