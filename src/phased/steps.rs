//! The steps of an attempt on a synchronous connection, as the body of
//! [`Phased::run`](super::Phased::run) receives them: each drives the attempt's one protocol
//! (`attempt.rs`) to its end at once.

use std::fmt;
use std::panic::{self, AssertUnwindSafe};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::attempt::{Attempt, Finished, Repeat};
use crate::backend::block_on;
use crate::backend::phases::BlockingPhaseStore;
use crate::error::Error;
use crate::outcome::Answered;

/// The steps of one attempt of a [`Phased`](super::Phased) operation, as its body receives
/// them.
pub struct Steps<'a, C> {
    attempt: Attempt<'a, C>,
}

impl<C> fmt::Debug for Steps<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (operation, position) = self.attempt.describe();
        f.debug_struct("Steps")
            .field("operation", &operation)
            .field("position", &position)
            .finish_non_exhaustive()
    }
}

impl<'a, C: BlockingPhaseStore> Steps<'a, C> {
    /// Runs `body` on the steps of `attempt` to its end: the response it
    /// finished with and when its retention ends. A failure or a panic
    /// frees the lease first, so that a retry resumes at once.
    pub(super) fn attempt<R, E>(
        attempt: Attempt<'a, C>,
        body: impl FnOnce(&mut Self) -> Result<Finished<R>, Error<E>>,
    ) -> Result<Answered<R>, Error<E>> {
        let mut steps = Steps { attempt };
        let ended = panic::catch_unwind(AssertUnwindSafe(|| body(&mut steps)));
        block_on(steps.attempt.end(ended))
    }

    /// Runs `f` in a transaction of its own and commits its output with the
    /// recovery point, or returns the output stored by an earlier attempt
    /// without running `f`.
    ///
    /// # Errors
    ///
    /// [`Error::Operation`] when `f` fails (its writes roll back);
    /// [`Error::InProgress`] when another attempt took the operation over
    /// (the phase rolls back); [`Error::PhaseRenamed`], [`Error::Codec`],
    /// [`Error::Storage`] as for [`Phased::run`](super::Phased::run).
    pub fn phase<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(&mut C) -> Result<T, E>,
    {
        block_on(self.attempt.phase(name, async |tx: &mut C| f(tx)))
    }

    /// Calls a provider outside any transaction, with a provider key it
    /// deduplicates on, and commits the result; an earlier attempt's
    /// committed result is returned without calling.
    ///
    /// The call is recorded as started before it is first made. A resume
    /// finding it started but without a result calls again with the same
    /// key, up to the [`provider_horizon`](super::Phased::provider_horizon) after
    /// the first call; past it the operation is parked. A failure the
    /// provider answered definitively (a declined card) should be returned
    /// as `Ok`, so that it is stored and replayed.
    ///
    /// # Errors
    ///
    /// [`Error::Operation`] when `f` fails: the call stays started, a retry
    /// calls again. [`Error::Parked`] past the horizon. Otherwise as
    /// [`phase`](Steps::phase).
    pub fn call<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(&str) -> Result<T, E>,
    {
        block_on(self.attempt.call(name, async |key: &str| f(key), Repeat::UntilHorizon))
    }

    /// [`call`](Steps::call) for a provider that does not deduplicate: a
    /// resume finding the call started without a result parks the operation
    /// instead of calling again, since the provider may have applied it.
    ///
    /// # Errors
    ///
    /// As [`call`](Steps::call); [`Error::Parked`] for a call that was
    /// interrupted.
    pub fn call_at_most_once<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(&str) -> Result<T, E>,
    {
        block_on(self.attempt.call(name, async |key: &str| f(key), Repeat::Never))
    }

    /// The provider key of the next call named `name`: derived from the id
    /// minted at the operation's first commit, so the same on every attempt
    /// and unrelated to the client's key. Calls that share a name (one per
    /// card of a loop) get a key each, numbered by how many calls of that
    /// name came before. `None` before the first commit.
    pub fn provider_key(&self, name: &str) -> Option<String> {
        self.attempt.provider_key(name)
    }

    /// Runs `f` in the last transaction, stores its result as the
    /// operation's response and completes the operation: every later retry
    /// replays it.
    ///
    /// # Errors
    ///
    /// As [`phase`](Steps::phase).
    pub fn finish<R, E, F>(&mut self, f: F) -> Result<Finished<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut C) -> Result<R, E>,
    {
        block_on(self.attempt.finish(async |tx: &mut C| f(tx)))
    }
}
