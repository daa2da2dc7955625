//! How the statements' futures are driven. Each table's store trait
//! (`keys`, `phases`, `outbox`) is async-shaped: a synchronous connection's
//! methods are `async fn`s whose statements complete as they are sent, a
//! diesel-async connection's await theirs. A synchronous entry point of the
//! crate drives its call to the end with [`block_on`]. What the diesel-async
//! connections with diesel-async's own transaction manager share is here as
//! well (`AsyncTransaction`, `end_transaction`), and so is [`catch_unwind`],
//! which catches a panic across `await`s for the code that must end what the
//! panic left open whichever kind of connection it runs on.

use std::future::{Future, poll_fn};
use std::panic::{self, AssertUnwindSafe};
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread;

/// The output of `future`, driven on this thread: a call on a synchronous
/// connection, or an operation that is a plain closure.
///
/// A synchronous connection's statements complete as they are sent, so
/// such a future is ready at its first poll and this costs one poll. Should
/// one ever wait, the thread parks until it is woken, as any executor's
/// `block_on` does, rather than fail.
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    /// Wakes the thread that polls.
    struct Unpark(thread::Thread);

    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }

    let mut future = pin!(future);
    // The first poll needs no waker of its own: a future that is ready at
    // once, as a synchronous connection's is, never wakes one.
    if let Poll::Ready(output) = future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        return output;
    }
    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        thread::park();
    }
}

/// A panic caught while a future was polled, to go on with once what it
/// interrupted is cleaned up.
pub(crate) type Panic = Box<dyn std::any::Any + Send>;

/// The output of `future`, or the payload of a panic raised while it was
/// polled: on either kind of connection the same code then ends what the
/// panic left open (a transaction, a key's lock) before the panic goes on.
pub(crate) async fn catch_unwind<F: Future>(future: F) -> Result<F::Output, Panic> {
    let mut future = pin!(future);
    poll_fn(
        |cx| match panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => Poll::Ready(Err(payload)),
        },
    )
    .await
}

#[cfg(any(feature = "postgres-async", feature = "mysql-async"))]
pub(crate) use asynchronous::{AsyncTransaction, async_transaction_depth, async_unwind_to_depth, end_transaction};

/// The transactions of the diesel-async connections whose transaction
/// manager is diesel-async's own (PostgreSQL's and MySQL's).
#[cfg(any(feature = "postgres-async", feature = "mysql-async"))]
mod asynchronous {
    use std::ops::{Deref, DerefMut};

    use diesel::QueryResult;
    use diesel_async::{AnsiTransactionManager, AsyncConnection, TransactionManager};

    /// An async connection inside a transaction the crate opened, until
    /// [`end_transaction`] ends it. Dropped before that (its call's future
    /// was dropped at an `await`, by a timeout, say, or by a server whose
    /// client hung up), it marks the connection's transactions broken:
    /// diesel refuses to open or commit another on it, and a bb8 or
    /// deadpool pool drops the connection instead of lending it again,
    /// which closes it; the server then rolls the transaction back and
    /// frees the key.
    pub(crate) struct AsyncTransaction<'c, C: AsyncConnection> {
        conn: &'c mut C,
        open: bool,
    }

    impl<'c, C: AsyncConnection> AsyncTransaction<'c, C> {
        /// `conn`, whose transaction (or savepoint) was just opened.
        pub(crate) fn opened(conn: &'c mut C) -> Self {
            AsyncTransaction { conn, open: true }
        }
    }

    impl<C: AsyncConnection> Deref for AsyncTransaction<'_, C> {
        type Target = C;
        fn deref(&self) -> &C {
            self.conn
        }
    }

    impl<C: AsyncConnection> DerefMut for AsyncTransaction<'_, C> {
        fn deref_mut(&mut self) -> &mut C {
            self.conn
        }
    }

    impl<C: AsyncConnection> Drop for AsyncTransaction<'_, C> {
        fn drop(&mut self) {
            if self.open {
                C::TransactionManager::transaction_manager_status_mut(self.conn).set_in_error();
            }
        }
    }

    /// Commits the innermost level of `tx` if `result` is a success and
    /// rolls it back otherwise, as diesel-async's own `transaction` does
    /// for the `BEGIN` it sends itself.
    pub(crate) async fn end_transaction<C, T, E>(mut tx: AsyncTransaction<'_, C>, result: Result<T, E>) -> Result<T, E>
    where
        C: AsyncConnection<TransactionManager = AnsiTransactionManager>,
        E: From<diesel::result::Error>,
    {
        let ended: QueryResult<()> = match &result {
            Ok(_) => AnsiTransactionManager::commit_transaction(&mut *tx).await,
            Err(_) => match AnsiTransactionManager::rollback_transaction(&mut *tx).await {
                Err(diesel::result::Error::BrokenTransactionManager) => Ok(()),
                other => other,
            },
        };
        // Ended, or failed in a way diesel-async recorded on the connection.
        tx.open = false;
        match ended {
            Ok(()) => result,
            Err(error) => Err(error.into()),
        }
    }

    /// How deep `conn`'s open transactions are nested; 0 outside one.
    pub(crate) fn async_transaction_depth<C>(conn: &mut C) -> QueryResult<u32>
    where
        C: AsyncConnection<TransactionManager = AnsiTransactionManager>,
    {
        let depth = AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth()?;
        Ok(depth.map_or(0, |depth| depth.get()))
    }

    /// Rolls back the levels of `conn` above `depth`.
    pub(crate) async fn async_unwind_to_depth<C>(conn: &mut C, depth: u32) -> QueryResult<()>
    where
        C: AsyncConnection<TransactionManager = AnsiTransactionManager>,
    {
        while async_transaction_depth(conn)? > depth {
            AnsiTransactionManager::rollback_transaction(conn).await?;
        }
        Ok(())
    }
}
