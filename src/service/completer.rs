//! The completer as a background service.

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};

use super::{Next, Shutdown, Stopped, serve};
use crate::backend::RawConnection;
use crate::phased::{Completer, Completions};

impl<C> Completer<C>
where
    C: RawConnection + 'static,
{
    /// Passes until `shutdown` is triggered, one every
    /// [`poll_interval`](Completer::poll_interval) (at once again after a
    /// full batch): the completer as a background service. A database
    /// error is reported and counted in [`Stopped::errors`], and the
    /// completer carries on after a pause that doubles from 100 ms up to
    /// 10 s. An operation being resumed when `shutdown` is triggered
    /// finishes first; a wait for a pooled connection ends at once. A panic
    /// in a registered operation is a failed attempt of that operation, as
    /// in [`run_once`](Completer::run_once), and the service goes on.
    pub fn run(&self, pool: &Pool<ConnectionManager<C>>, shutdown: &Shutdown) -> Stopped<Completions>
    where
        C: R2D2Connection + Send,
    {
        let stop = || shutdown.is_triggered();
        serve(
            "completer",
            pool,
            shutdown,
            pool.connection_timeout(),
            &stop,
            |conn, done| {
                let pass = self.run_once(&mut **conn)?;
                *done += pass;
                Ok(match pass.picked < self.batch_size {
                    true => Next::Sleep(self.poll_interval),
                    false => Next::Now,
                })
            },
        )
    }
}
