//! A phased operation: its name and policy, and the start of an attempt,
//! which replays a finished operation or takes its lease (fresh, or over
//! from an attempt whose lease ran out) and hands the body to its
//! [`Steps`], or on a diesel-async connection its [`AsyncSteps`](super::AsyncSteps).

use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

#[cfg(feature = "diesel-async")]
use super::async_steps::AsyncSteps;
use super::attempt::{Attempt, Finished, OperationHold, write_failed};
use super::definition::{Admitted, Phased};
use super::steps::Steps;
#[cfg(feature = "diesel-async")]
use crate::backend::AsyncStoreConnection;
use crate::backend::phases::{Lease, PhaseStore};
use crate::backend::{BackendRules, RulesOf, StoreConnection, block_on};
use crate::clock::Reading;
use crate::config::OnCompleted;
use crate::error::Error;
use crate::outcome::{Answered, Origin, Outcome};
use crate::row_status::OperationStatus;
use crate::run::{KeyStatus, Sender};
use crate::telemetry::CallTrace;
use crate::{codec, id, telemetry};

/// How often a retry looks again while another attempt holds the lease.
const LEASE_POLL: std::time::Duration = std::time::Duration::from_millis(25);

impl Phased {
    /// Runs the operation `body` for `(scope, key)` at most once, resuming
    /// it from its last recovery point, or replays its stored response.
    ///
    /// `body` receives the [`Steps`] and returns what [`Steps::finish`]
    /// returned. Each step returns `Result<T, Error<E>>`, so `?` passes a
    /// step's failure on. `conn` must not be inside a transaction: every
    /// step commits on its own.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidScope`], [`Error::InvalidKey`]: refused before
    ///   anything was read or written.
    /// - [`Error::Mismatch`]: the key is bound to another request or to
    ///   another operation (another name).
    /// - [`Error::AlreadyCompleted`]: the operation has finished, and the
    ///   [`Config`](crate::Config) rejects completed keys rather than
    ///   replaying them.
    /// - [`Error::Expired`]: the operation finished, its retention has
    ///   ended, and the [`Config`](crate::Config) keeps its
    ///   [tombstone](crate::Config::tombstones) for a grace period that
    ///   runs; nothing runs again until it ends.
    /// - [`Error::InProgress`]: another attempt holds the operation beyond
    ///   the in-flight policy, or took it over from this one.
    /// - [`Error::Operation`]: a step's closure failed. Before the first
    ///   commit the key stays free; after it the recovery point is kept and
    ///   a retry with the same request resumes.
    /// - [`Error::Parked`]: the operation was given up for a person (a call
    ///   past its provider horizon, an interrupted at-most-once call, too
    ///   many attempts).
    /// - [`Error::PhaseRenamed`]: a step's name differs from the one
    ///   recorded at its position.
    /// - [`Error::Codec`]: a value did not serialize or read back.
    /// - [`Error::Storage`]: the database failed (`AlreadyInTransaction`
    ///   when `conn` is in a transaction).
    ///
    /// # Panics
    ///
    /// A panic in `body` rolls back the step it was in, frees the lease and
    /// resumes; committed recovery points stay. `run` panics itself (after
    /// freeing the lease) when `body` returns a [`Finished`] that its own
    /// [`finish`](Steps::finish) did not make, one kept from another
    /// operation.
    pub fn run<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        body: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut Steps<'_, C::Raw>) -> Result<Finished<R>, Error<E>>,
    {
        self.run_recorded(conn, scope, key, request, Sender::default(), body)
            .map(|(outcome, ..)| outcome)
    }

    /// [`run`](Phased::run), also telling when the operation's retention
    /// ends and where its result came from: the HTTP layer sends them to
    /// the client. The operation is answered to the lookups of `sender`'s
    /// caller alone, and keeps its request id.
    pub(crate) fn run_recorded<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        sender: Sender<'_>,
        body: F,
    ) -> Result<Answered<R>, Error<E>>
    where
        C: StoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: FnOnce(&mut Steps<'_, C::Raw>) -> Result<Finished<R>, Error<E>>,
    {
        let trace = CallTrace::phased(RulesOf::<C::Raw>::NAME, &self.name);
        let conn = conn.raw();
        // In the attempt's span, so that its events carry the operation, the
        // scope, the key and the backend.
        let result = trace.span().in_scope(|| {
            let admitted = self.admit::<RulesOf<C::Raw>, Q, E>(scope, key, request, sender, &trace)?;
            match block_on(self.start(conn, scope, key, &admitted))? {
                Begin::Replay(answered) => Ok(answered),
                Begin::Attempt(attempt) => Steps::attempt(*attempt, body),
            }
        });
        trace.finish_phased(result.as_ref().map(|(outcome, ..)| outcome));
        result
    }

    /// [`run`](Phased::run) on a diesel-async connection (feature
    /// `diesel-async`): `body` is an async closure that gets the
    /// [`AsyncSteps`], whose steps take async closures and are awaited, so
    /// that a foreign call awaits its provider instead of blocking a
    /// thread. The contract is [`run`](Phased::run)'s on every point, by
    /// the same code; what a dropped future does is in the
    /// [async guide](crate::guide::asynchronous).
    ///
    /// # Errors
    ///
    /// As [`run`](Phased::run).
    ///
    /// # Panics
    ///
    /// As [`run`](Phased::run).
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 1)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use diesel::SqliteConnection;
    /// use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
    /// use diesel_async::SimpleAsyncConnection;
    /// use idempotency::phased::{AsyncSteps, Phased};
    ///
    /// type Conn = SyncConnectionWrapper<SqliteConnection>;
    ///
    /// /// A provider reached over the network, deduplicating on its key.
    /// async fn charge(cents: u32, provider_key: &str) -> Result<String, std::io::Error> {
    ///     Ok(format!("ch_{}_{cents}", &provider_key[..8]))
    /// }
    ///
    /// let mut conn = idempotency::testing::sqlite_memory_async();
    /// conn.batch_execute("CREATE TABLE rides (rider TEXT NOT NULL, charge TEXT)").await?;
    /// let create_ride = Phased::new("create-ride");
    /// let outcome = create_ride
    ///     .run_async(&mut conn, "rider-ada", "ride-7c1e", &"ada", async |s: &mut AsyncSteps<'_, Conn>| {
    ///         s.phase("ride_created", async |tx: &mut Conn| {
    ///             tx.batch_execute("INSERT INTO rides (rider) VALUES ('ada')").await.map_err(std::io::Error::other)
    ///         })
    ///         .await?;
    ///         let charge = s.call("charged", async |provider_key: &str| charge(20_00, provider_key).await).await?;
    ///         s.finish(async |_: &mut Conn| Ok::<_, std::io::Error>(charge)).await
    ///     })
    ///     .await?;
    /// assert!(outcome.into_inner().starts_with("ch_"));
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "diesel-async")]
    pub async fn run_async<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        body: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        C: AsyncStoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut AsyncSteps<'_, C>) -> Result<Finished<R>, Error<E>>,
    {
        self.run_recorded_async(conn, scope, key, request, Sender::default(), body)
            .await
            .map(|(outcome, ..)| outcome)
    }

    /// [`run_async`](Phased::run_async), also telling when the operation's
    /// retention ends and where its result came from, for `sender`, as
    /// [`run_recorded`](Phased::run_recorded).
    #[cfg(feature = "diesel-async")]
    pub(crate) async fn run_recorded_async<C, Q, R, E, F>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &Q,
        sender: Sender<'_>,
        body: F,
    ) -> Result<Answered<R>, Error<E>>
    where
        C: AsyncStoreConnection,
        Q: Serialize + ?Sized,
        R: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut AsyncSteps<'_, C>) -> Result<Finished<R>, Error<E>>,
    {
        use tracing::Instrument;

        let trace = CallTrace::phased(C::Rules::NAME, &self.name);
        let span = trace.span().clone();
        // Boxed, as `Config::run_recorded_async` is: a caller's future that
        // held the attempt whole would be deeper than rustc lays out.
        let result = Box::pin(
            async {
                let admitted = self.admit::<C::Rules, Q, E>(scope, key, request, sender, &trace)?;
                match self.start(conn, scope, key, &admitted).await? {
                    Begin::Replay(answered) => Ok(answered),
                    Begin::Attempt(attempt) => AsyncSteps::attempt(*attempt, body).await,
                }
            }
            .instrument(span),
        )
        .await;
        trace.finish_phased(result.as_ref().map(|(outcome, ..)| outcome));
        result
    }

    /// What became of this operation for `request` under `key` in
    /// `scope`, as a retry would find it: [`InProgress`](KeyStatus::InProgress)
    /// while it runs (an attempt holds it, or it waits for a retry or a
    /// [`Completer`](super::Completer) to resume it),
    /// [`Completed`](KeyStatus::Completed) with its response once finished,
    /// [`Tombstoned`](KeyStatus::Tombstoned) after its retention where the
    /// policy keeps [tombstones](crate::Config::tombstones), until their
    /// grace period ends, [`Expired`](KeyStatus::Expired) after that,
    /// [`Parked`](KeyStatus::Parked) while it waits for a person. It never
    /// runs a step and never writes.
    ///
    /// As [`Config::status`](crate::Config::status) for a single call, the lookup answers only
    /// what a retry would: an operation of another request or of another
    /// operation (another name) is [`NoRecord`](KeyStatus::NoRecord),
    /// exactly as a key without one.
    ///
    /// # Errors
    ///
    /// As [`Config::status`](crate::Config::status).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use idempotency::phased::Phased;
    /// use idempotency::KeyStatus;
    ///
    /// let mut conn = idempotency::testing::sqlite_memory();
    /// let create_ride = Phased::new("create-ride");
    /// assert_eq!(create_ride.status::<_, String>(&mut conn, "rider-ada", "ride-7c1e", &"ada")?, KeyStatus::NoRecord);
    ///
    /// create_ride.run(&mut conn, "rider-ada", "ride-7c1e", &"ada", |s| {
    ///     let charge = s.call("charged", |provider_key| Ok::<_, std::io::Error>(format!("ch_{}", &provider_key[..8])))?;
    ///     s.finish(|_| Ok::<_, std::io::Error>(charge))
    /// })?;
    /// let KeyStatus::Completed { response, .. } = create_ride.status::<_, String>(&mut conn, "rider-ada", "ride-7c1e", &"ada")? else {
    ///     return Err("not finished".into());
    /// };
    /// assert!(response.starts_with("ch_"));
    /// // Another operation under the key learns nothing of it.
    /// let refund = Phased::new("refund-ride");
    /// assert_eq!(refund.status::<_, String>(&mut conn, "rider-ada", "ride-7c1e", &"ada")?, KeyStatus::NoRecord);
    /// # Ok(())
    /// # }
    /// ```
    pub fn status<C, R>(
        &self,
        conn: &mut C,
        scope: &str,
        key: &str,
        request: &(impl Serialize + ?Sized),
    ) -> Result<KeyStatus<R>, Error>
    where
        C: StoreConnection,
        R: DeserializeOwned,
    {
        self.config.request_status(conn, scope, key, Some(&self.name), request)
    }

    /// What every attempt does before it reads: the key rules, the
    /// request's fingerprint, the request to store, the token of the lease
    /// it may take, whom its lookups answer, and where a result it executes
    /// comes from. Called inside the attempt's span.
    fn admit<R: BackendRules, Q: Serialize + ?Sized, E>(
        &self,
        scope: &str,
        key: &str,
        request: &Q,
        sender: Sender<'_>,
        trace: &CallTrace,
    ) -> Result<Admitted, Error<E>> {
        let request_hash = self.config.admit::<R, Q, E>(scope, key, request, trace)?;
        let request = match self.store_requests {
            true => Some(codec::to_readable_json(request).map_err(Error::Codec)?),
            false => None,
        };
        Ok(Admitted {
            request_hash,
            request,
            token: id::new(),
            caller_hash: sender.caller_hash.map(str::to_owned),
            origin: Origin {
                traceparent: crate::telemetry::execution_traceparent(),
                request_id: sender.request_id.map(str::to_owned),
            },
        })
    }

    /// Reads the operation and decides: replay it, or attempt it (fresh, or
    /// taken over from an attempt whose lease ran out), waiting for a live
    /// lease as the in-flight policy allows.
    async fn start<'a, C: PhaseStore, R: DeserializeOwned, E>(
        &'a self,
        conn: &'a mut C,
        scope: &'a str,
        key: &'a str,
        admitted: &'a Admitted,
    ) -> Result<Begin<'a, C, R>, Error<E>> {
        if conn.transaction_depth()? > 0 {
            return Err(Error::Storage(diesel::result::Error::AlreadyInTransaction));
        }
        let request_hash = admitted.request_hash.as_str();
        // The lease of this attempt, whether it claims the operation or
        // takes it over.
        let lease = Lease {
            scope,
            key,
            token: &admitted.token,
        };
        let attempt = |conn, (held, origin), clock| {
            Begin::Attempt(Box::new(Attempt::new(
                self,
                conn,
                lease,
                admitted,
                (held, origin),
                clock,
            )))
        };
        let wait = std::time::Duration::from_millis(u64::try_from(self.config.in_flight.wait_millis()).unwrap_or(0));
        let deadline = Instant::now() + wait;
        loop {
            let (row, database_now) = conn.read_operation(scope, key).await?;
            let now = self.config.clock.or_database(database_now);
            let clock = Reading::new(&self.config.clock, now);
            let Some(row) = row else {
                let held = OperationHold::Unclaimed { replace: false };
                return Ok(attempt(conn, (held, admitted.origin.clone()), clock));
            };
            // Past its retention, and past the grace period of its
            // tombstone where the policy keeps one: run anew.
            let reusable_by = self.config.reusable_by(now);
            if row.status == OperationStatus::Completed
                && row.expires_at.is_some_and(|expires_at| expires_at <= reusable_by)
            {
                let held = OperationHold::Unclaimed { replace: true };
                return Ok(attempt(conn, (held, admitted.origin.clone()), clock));
            }
            // The key is bound to the operation as well as to the request:
            // another operation's response is not this one's, nor are its
            // recovery points. Compared with the name stored since the first
            // version rather than folded into the fingerprint, so that
            // operations written before keep their fingerprints.
            if row.operation != self.name || row.request_hash != request_hash {
                return Err(Error::Mismatch);
            }
            match row.status {
                // A tombstone: past its retention, inside the grace period.
                OperationStatus::Completed if row.expires_at.is_some_and(|expires_at| expires_at <= now) => {
                    return Err(Error::Expired);
                }
                OperationStatus::Completed => {
                    if self.config.on_completed == OnCompleted::Reject {
                        return Err(Error::AlreadyCompleted);
                    }
                    let value =
                        serde_json::from_str(row.response.as_deref().unwrap_or_default()).map_err(Error::Codec)?;
                    if self.config.durable_replays {
                        conn.await_replication().await?;
                    }
                    let expires_at = row.expires_at.unwrap_or(now).and_utc();
                    crate::telemetry::link_to_execution(row.traceparent.as_deref());
                    return Ok(Begin::Replay((Outcome::Replayed(value), expires_at, row.origin())));
                }
                OperationStatus::Parked => return Err(Error::Parked),
                OperationStatus::Running => {}
            }
            if row.lease_until.is_none_or(|until| until <= now) {
                // The recovery points are read again once the lease is this
                // attempt's: since the read above, another attempt may have
                // taken the operation over, committed steps and let go.
                let taken = conn
                    .write(self.config.in_flight, async |tx| {
                        if !tx.take_over(lease, now + self.lease, now).await? {
                            return Ok(None);
                        }
                        tx.read_operation(scope, key).await.map(|(row, _)| row)
                    })
                    .await
                    .map_err(write_failed::<C, E>)?;
                if let Some(row) = taken {
                    tracing::info!(target: telemetry::TARGET, "resuming from the last recovery point");
                    let origin = row.origin();
                    let held = OperationHold::resumed(row).map_err(Error::Codec)?;
                    return Ok(attempt(conn, (held, origin), clock));
                }
            } else if Instant::now() >= deadline {
                return Err(Error::InProgress);
            } else {
                conn.pause(LEASE_POLL.min(deadline.saturating_duration_since(Instant::now())))
                    .await;
            }
        }
    }
}

/// What [`Phased::start`] decided.
enum Begin<'a, C, R> {
    Replay(Answered<R>),
    Attempt(Box<Attempt<'a, C>>),
}
