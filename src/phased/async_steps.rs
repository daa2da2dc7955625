//! The steps of an attempt on a diesel-async connection (feature
//! `diesel-async`), as the body of [`Phased::run_async`](super::Phased::run_async) receives them: the
//! attempt's one protocol (`attempt.rs`), awaited.

use std::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::attempt::{Attempt, Finished, Repeat};
use crate::backend::{AsyncStoreConnection, catch_unwind};
use crate::error::Error;
use crate::outcome::Answered;

/// The steps of one attempt of a [`Phased`](super::Phased) operation on a diesel-async
/// connection, as the body of [`Phased::run_async`](super::Phased::run_async) receives them: the
/// [`Steps`](super::Steps) of a synchronous connection, each step an async closure,
/// awaited. Every step keeps the contract of its namesake in [`Steps`](super::Steps).
pub struct AsyncSteps<'a, C> {
    attempt: Attempt<'a, C>,
}

impl<C> fmt::Debug for AsyncSteps<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (operation, position) = self.attempt.describe();
        f.debug_struct("AsyncSteps")
            .field("operation", &operation)
            .field("position", &position)
            .finish_non_exhaustive()
    }
}

impl<'a, C: AsyncStoreConnection> AsyncSteps<'a, C> {
    /// Runs `body` on the steps of `attempt` to its end, as
    /// [`Steps`](super::Steps) does.
    pub(super) async fn attempt<R, E>(
        attempt: Attempt<'a, C>,
        body: impl AsyncFnOnce(&mut Self) -> Result<Finished<R>, Error<E>>,
    ) -> Result<Answered<R>, Error<E>> {
        let mut steps = AsyncSteps { attempt };
        let ended = catch_unwind(body(&mut steps)).await;
        steps.attempt.end(ended).await
    }

    /// [`Steps::phase`](super::Steps::phase): `f` runs on the connection in a transaction of its
    /// own, which commits its output with the recovery point.
    ///
    /// # Errors
    ///
    /// As [`Steps::phase`](super::Steps::phase).
    pub async fn phase<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut C) -> Result<T, E>,
    {
        self.attempt.phase(name, f).await
    }

    /// [`Steps::call`](super::Steps::call): `f` gets the provider key and is awaited outside
    /// any transaction; its result is committed.
    ///
    /// # Errors
    ///
    /// As [`Steps::call`](super::Steps::call).
    pub async fn call<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&str) -> Result<T, E>,
    {
        self.attempt.call(name, f, Repeat::UntilHorizon).await
    }

    /// [`Steps::call_at_most_once`](super::Steps::call_at_most_once), `f` awaited.
    ///
    /// # Errors
    ///
    /// As [`Steps::call_at_most_once`](super::Steps::call_at_most_once).
    pub async fn call_at_most_once<T, E, F>(&mut self, name: &str, f: F) -> Result<T, Error<E>>
    where
        T: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&str) -> Result<T, E>,
    {
        self.attempt.call(name, f, Repeat::Never).await
    }

    /// [`Steps::provider_key`](super::Steps::provider_key).
    pub fn provider_key(&self, name: &str) -> Option<String> {
        self.attempt.provider_key(name)
    }

    /// [`Steps::finish`](super::Steps::finish): `f` runs in the last transaction, which stores its
    /// result as the operation's response.
    ///
    /// # Errors
    ///
    /// As [`Steps::finish`](super::Steps::finish).
    pub async fn finish<R, E, F>(&mut self, f: F) -> Result<Finished<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut C) -> Result<R, E>,
    {
        self.attempt.finish(f).await
    }
}
