//! One call from its read to its commit: the answer from a stored record,
//! or the write path that holds the key, runs the operation and stores its
//! result. The write path's transaction, [`within_key`], is every
//! step's of a [phased operation](crate::phased) as well.

use std::panic;
use std::time::Instant;

use chrono::{Duration, NaiveDateTime, SubsecRound};
use diesel::QueryResult;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::{
    BackendRules, Claim, HeldKey, Hold, KeyNotClaimed, KeyRecordChanged, KeyStore, Panic, Read, Record, Stored,
    catch_unwind,
};
use crate::clock::Clock;
use crate::codec;
use crate::config::{Config, OnCompleted};
use crate::error::Error;
use crate::executing::Executing;
use crate::in_flight::InFlight;
use crate::outcome::{Origin, Outcome, Recorded};
use crate::row_status::RecordStatus;
use crate::sql_time::At;
use crate::telemetry::CallTrace;

/// The call of [`Config::run_recorded`] once `scope` and `key` passed the
/// key rules and the request is fingerprinted (`request_hash`), sent by
/// `sender`: a replay
/// from one read, or the write path, which holds the key (a key the read
/// found no record for claimed in the round trip that takes it, where the
/// backend can; by a claim at once where the read found that the database
/// `claims_first`), then replays what another call stored meanwhile, or
/// runs `op` and stores its result.
///
/// Written once for both kinds of connection: a synchronous one completes
/// every statement as it is sent (see [`KeyStore`]), an async one awaits it.
pub(super) async fn recorded<C, R, E, F>(
    config: &Config,
    conn: &mut C,
    scope: &str,
    key: &str,
    (request_hash, sender): (&str, Sender<'_>),
    trace: &CallTrace,
    op: F,
) -> Result<Recorded<R>, Error<E>>
where
    C: KeyStore,
    R: Serialize + DeserializeOwned,
    F: AsyncFnOnce(&mut C) -> Result<R, E>,
{
    let traceparent = crate::telemetry::execution_traceparent();
    let call = Call {
        config,
        scope,
        key,
        request_hash,
        caller_hash: sender.caller_hash,
        traceparent: traceparent.as_deref(),
        request_id: sender.request_id,
        trace,
    };
    let reads_first = config
        .read_before_transaction
        .unwrap_or(<C::Rules as BackendRules>::READS_BEFORE_TRANSACTION);
    if reads_first || conn.transaction_depth()? > 0 {
        return read_first(call, conn, op).await;
    }
    let retention = config.retention.num_microseconds();
    let (op, waited) = match (C::CLAIMS_AT_DATABASE_TIME, &config.clock, retention) {
        (true, Clock::Database, Some(retention)) => match claimed_at_database_time(call, conn, retention, op).await {
            Ok(answer) => return answer,
            Err((op, reason)) => (op, reason == KeyNotClaimed::Failed),
        },
        _ => {
            let now = config.clock.or_database_now(conn).await?;
            return write_path(call, conn, (now, false, true), op).await;
        }
    };
    // A record the claim met is read as it would have been first; a failed
    // round trip may have waited for the key's lock as long as the policy
    // allows, so the call waits no longer.
    if waited {
        let config = &config.clone().in_flight(InFlight::Reject);
        return read_first(Call { config, ..call }, conn, op).await;
    }
    read_first(call, conn, op).await
}

/// Who sent a call, where the application or its HTTP layer knows: whose
/// lookups the record answers, and the id the application gave the
/// request, which the record keeps as its [`Origin`]'s.
#[derive(Clone, Copy, Default)]
pub(crate) struct Sender<'a> {
    /// The hash of the caller and endpoint (the HTTP layer's).
    pub(crate) caller_hash: Option<&'a str>,
    /// The request's id: one a record keeps ([`Origin::keeps_request_id`]),
    /// as the HTTP layer's key and gRPC's read it, who leave out any other.
    pub(crate) request_id: Option<&'a str>,
}

/// A call once its key passed the key rules and its request is
/// fingerprinted: what every path it may take reads.
#[derive(Clone, Copy)]
struct Call<'a> {
    config: &'a Config,
    scope: &'a str,
    key: &'a str,
    request_hash: &'a str,
    /// Whose lookups the record answers, where the call came over HTTP.
    caller_hash: Option<&'a str>,
    /// The `traceparent` of the span the call runs in, if traced.
    traceparent: Option<&'a str>,
    /// The request's id, if the sender gave one the record keeps.
    request_id: Option<&'a str>,
    trace: &'a CallTrace,
}

impl<'a> Call<'a> {
    /// The record this call claims its key with: `processing`, without a
    /// response, created at `created_at`, expiring at `expires_at`, and
    /// taking over a record of the key that expired by `reusable_by`.
    fn claim(&self, created_at: NaiveDateTime, expires_at: NaiveDateTime, reusable_by: NaiveDateTime) -> Record<'a> {
        Record {
            scope: self.scope,
            idempotency_key: self.key,
            request_hash: self.request_hash,
            status: RecordStatus::Processing,
            response: None,
            created_at,
            completed_at: None,
            expires_at,
            caller_hash: self.caller_hash,
            traceparent: self.traceparent,
            request_id: self.request_id,
            reusable_by,
        }
    }

    /// The origin of a result this call executes.
    fn origin(&self) -> Origin {
        Origin::kept(self.traceparent, self.request_id)
    }
}

/// A first call with no read before its transaction, on a backend that
/// claims a key at the database's time in the round trip that takes it
/// ([`Claim::AtDatabaseTime`]): the claim, the operation and the
/// completion, which returns the times the claim was stamped with. Where
/// the claim is not made (the key has a record, or the round trip failed),
/// nothing was written and `op` comes back with the reason.
async fn claimed_at_database_time<C, R, E, F>(
    call: Call<'_>,
    conn: &mut C,
    retention: i64,
    op: F,
) -> Result<Result<Recorded<R>, Error<E>>, (F, KeyNotClaimed)>
where
    C: KeyStore,
    R: Serialize + DeserializeOwned,
    F: AsyncFnOnce(&mut C) -> Result<R, E>,
{
    // Its times are not written, for the claim stamps the record with the
    // database's, and a plain insert takes over no record.
    let record = call.claim(NaiveDateTime::MIN, NaiveDateTime::MIN, NaiveDateTime::MIN);
    // The work runs at most once, and only once the key is claimed; until
    // then `op` stays here, for the read that follows a claim not made.
    let mut op = Some(op);
    let slot = &mut op;
    let work = async |tx: &mut C, guard: &mut KeyWork, claimed: bool| {
        let (Some(op), true) = (slot.take(), claimed) else {
            // The backend took the key without the claim: the record is
            // not as this call left it.
            return Err(Error::Storage(KeyRecordChanged::error()));
        };
        let value = guard.catching_panic(tx, op).await?.map_err(Error::Operation)?;
        let response = stored_json(call.config, &value)?;
        let completed = Record {
            status: RecordStatus::Completed,
            response: Some(&response),
            ..record
        };
        let (created_at, expires_at) = tx.complete_at_database_time(&completed).await?;
        guard.committing();
        Ok(Recorded::new(
            Outcome::Executed(value),
            created_at,
            expires_at,
            call.origin(),
        ))
    };
    let claim = Claim::AtDatabaseTime {
        record: &record,
        retention_micros: retention,
    };
    let answer = within_key(
        conn,
        call.config,
        (call.scope, call.key),
        Some(call.trace),
        Some(claim),
        work,
    )
    .await;
    match (answer, op) {
        (Err(Error::Storage(error)), Some(op)) => match KeyNotClaimed::of(&error) {
            Some(reason) => Err((op, reason)),
            None => Ok(Err(Error::Storage(error))),
        },
        (answer, _) => Ok(answer),
    }
}

/// A call that reads its key's record before its write transaction: a
/// replay from that one read, or the write path.
async fn read_first<C, R, E, F>(call: Call<'_>, conn: &mut C, op: F) -> Result<Recorded<R>, Error<E>>
where
    C: KeyStore,
    R: Serialize + DeserializeOwned,
    F: AsyncFnOnce(&mut C) -> Result<R, E>,
{
    let Call { config, scope, key, .. } = call;
    // `fresh`: the read found no record, so the backend may claim the key
    // in the round trip that takes it.
    let (now, claims_first, fresh) = match conn.read(scope, key).await {
        Ok(Read {
            record,
            now,
            claims_first,
        }) => {
            let now = config.clock.or_database(now);
            match record {
                // Unexpired, or a tombstone (answered from this read as a
                // replay is).
                Some(stored)
                    if stored.status == RecordStatus::Completed && stored.expires_at > config.reusable_by(now) =>
                {
                    if config.durable_replays {
                        conn.await_replication().await?;
                    }
                    return replay(call, stored, now);
                }
                record => (now, claims_first, record.is_none()),
            }
        }
        // A reader kept out by a writer (SQLite outside WAL mode) takes the
        // write path, which waits as the in-flight policy allows and reads
        // again once it holds the lock.
        Err(error) if C::Rules::is_in_flight_timeout(&error) => {
            let now = conn.database_now().await?;
            (config.clock.or_database(now), false, false)
        }
        Err(error) => return Err(Error::Storage(error)),
    };
    write_path(call, conn, (now, claims_first, fresh), op).await
}

/// The write path as of `now`: the transaction that holds the key, then
/// replays what another call stored meanwhile, or runs `op` and stores its
/// result. `claims_first`: the database claims every key before the
/// operation; `fresh`: no record was found (or none was looked for), so the
/// backend may claim the key in the round trip that takes it.
async fn write_path<C, R, E, F>(
    call: Call<'_>,
    conn: &mut C,
    (now, claims_first, fresh): (NaiveDateTime, bool, bool),
    op: F,
) -> Result<Recorded<R>, Error<E>>
where
    C: KeyStore,
    R: Serialize + DeserializeOwned,
    F: AsyncFnOnce(&mut C) -> Result<R, E>,
{
    let Call {
        config,
        scope,
        key,
        trace,
        ..
    } = call;
    // The record this call writes if it executes, claimed as of `now`: to
    // the microsecond, as PostgreSQL keeps times, so that the times an
    // execution reports are the ones its replays read back.
    let now = now.trunc_subsecs(6);
    let record = call.claim(
        now,
        C::Rules::storable_time(now + config.retention),
        config.reusable_by(now),
    );
    let claim = fresh.then_some(Claim::Bound(&record));
    let work = async |tx: &mut C, guard: &mut KeyWork, claimed| {
        let hold = match claimed {
            true => Hold::Claimed { took_over: false },
            false => tx.hold(&record, claims_first).await?,
        };
        let hold = match hold {
            Hold::Recorded(stored) => {
                if config.durable_replays {
                    tx.await_replication().await?;
                }
                return replay(call, stored, now);
            }
            Hold::ClaimedElsewhere => return Err(Error::InProgress),
            hold @ (Hold::Expired | Hold::Claimed { took_over: true }) => {
                trace.took_over();
                hold
            }
            hold => hold,
        };
        let value = guard.catching_panic(tx, op).await?.map_err(Error::Operation)?;
        let response = stored_json(config, &value)?;
        let elapsed = Duration::from_std(guard.started.elapsed()).unwrap_or(Duration::zero());
        tx.store(
            hold,
            &Record {
                status: RecordStatus::Completed,
                response: Some(&response),
                completed_at: Some(At(now + elapsed)),
                ..record
            },
        )
        .await?;
        guard.committing();
        Ok(Recorded::new(
            Outcome::Executed(value),
            now,
            record.expires_at,
            call.origin(),
        ))
    };
    within_key(conn, config, (scope, key), Some(trace), claim, work).await
}

/// The answer from a stored record as of `now`: its response when the
/// request matches and the policy replays ([`Config::on_completed`]);
/// [`Error::Expired`] when the record is a tombstone (the policy keeps
/// [tombstones](Config::tombstones) and the record's retention has ended),
/// whose request is still compared first, so that only the request that
/// could have been replayed learns that it expired. A replay's span links
/// to the span of the execution it answers.
fn replay<R: DeserializeOwned, E>(call: Call<'_>, stored: Stored, now: NaiveDateTime) -> Result<Recorded<R>, Error<E>> {
    let Call {
        config, request_hash, ..
    } = call;
    if stored.request_hash != request_hash {
        return Err(Error::Mismatch);
    }
    if stored.status == RecordStatus::Completed && stored.expires_at <= now {
        return Err(Error::Expired);
    }
    match stored.response.as_deref() {
        Some(_) if stored.status == RecordStatus::Completed && config.on_completed == OnCompleted::Reject => {
            Err(Error::AlreadyCompleted)
        }
        Some(response) if stored.status == RecordStatus::Completed => {
            let value = serde_json::from_str(response).map_err(Error::Codec)?;
            crate::telemetry::link_to_execution(stored.traceparent.as_deref());
            let origin = stored.origin();
            Ok(Recorded::new(
                Outcome::Replayed(value),
                stored.created_at,
                stored.expires_at,
                origin,
            ))
        }
        // Claimed by an enclosing call on this same connection whose
        // operation has not finished.
        _ => Err(Error::InProgress),
    }
}

/// Runs `work` in a write transaction that holds `(scope, key)` against
/// every other call, as a single call's write path and every step of a
/// phased operation do; `work` is what each does once it holds the key.
/// Where the backend can, it writes `claim` in the round trip that takes
/// the key, and `work` learns so from its third argument (`claimed`).
///
/// A call that already executes the same key on `conn` (an enclosing one)
/// makes it [`Error::InProgress`] before anything is written. The wait for
/// the key is recorded on `trace`. The application's code runs through the
/// [`KeyWork`], so that a panic in it rolls the transaction back before it
/// goes on, and the connection is left as it was. A failure is reported as
/// [`call_error`] says; the commit's own failure as
/// [`Error::OutcomeUnknown`] only where `work` marked the transaction
/// [`committing`](KeyWork::committing) and it is this call's own, not a
/// savepoint in a caller's.
pub(crate) async fn within_key<C, T, E>(
    conn: &mut C,
    config: &Config,
    (scope, key): (&str, &str),
    trace: Option<&CallTrace>,
    claim: Option<Claim<'_>>,
    work: impl AsyncFnOnce(&mut C, &mut KeyWork, bool) -> Result<T, Error<E>>,
) -> Result<T, Error<E>>
where
    C: KeyStore,
{
    // An enclosing call on this connection that executes the same key has
    // written nothing yet for a nested call to find; and what the work
    // enqueues through the connection takes the call's scope from here.
    let Some(_executing) = Executing::enter(&*conn, scope, key) else {
        return Err(Error::InProgress);
    };
    let mut guard = KeyWork {
        started: Instant::now(),
        panicked: None,
        committing: false,
    };
    // Whether this call's own transaction commits: a nested call's
    // savepoint commits nothing by itself.
    let commits = conn.transaction_depth()? == 0;
    let held = HeldKey {
        scope,
        key,
        in_flight: config.in_flight,
        idle_timeout: config.idle_timeout,
        claim,
    };
    let guarded = &mut guard;
    let result = conn
        .key_transaction(held, async move |tx, claimed| {
            if let Some(trace) = trace {
                trace.waited(guarded.started.elapsed());
            }
            work(tx, guarded, claimed).await
        })
        .await;
    if let Some(payload) = guard.panicked {
        panic::resume_unwind(payload);
    }
    if let (Some(trace), Err(Error::Storage(error))) = (trace, &result)
        && C::Rules::is_in_flight_timeout(error)
    {
        trace.waited(guard.started.elapsed());
    }
    result.map_err(|error| call_error::<C::Rules, E>(error, commits && guard.committing))
}

/// What the work of a [`within_key`] runs the application's code
/// through, and marks the transaction with once it has written.
pub(crate) struct KeyWork {
    /// When the call began to wait for its key.
    started: Instant,
    panicked: Option<Panic>,
    committing: bool,
}

impl KeyWork {
    /// Runs `f`, the application's code, inside the key transaction. A panic
    /// in it rolls back the levels `f` opened and left open, is kept, and
    /// comes back as an error, which rolls the transaction's own level back
    /// as any error does; [`within_key`] resumes the panic once the
    /// transaction has ended, so the connection is left out of it. (A
    /// connection that cannot roll back is left marked broken, which makes
    /// its pool discard it.)
    pub(crate) async fn catching_panic<C: KeyStore, T>(
        &mut self,
        tx: &mut C,
        f: impl AsyncFnOnce(&mut C) -> T,
    ) -> QueryResult<T> {
        let depth = tx.transaction_depth()?;
        match catch_unwind(f(tx)).await {
            Ok(value) => Ok(value),
            Err(payload) => {
                let _ = tx.unwind_to_depth(depth).await;
                self.panicked = Some(payload);
                Err(diesel::result::Error::RollbackTransaction)
            }
        }
    }

    /// Marks the transaction as written and about to commit: a failure from
    /// here on is its commit's, which may have committed.
    pub(crate) fn committing(&mut self) {
        self.committing = true;
    }
}

/// What the failure of a call's write transaction tells its caller, the
/// same for a single call, a phased step and a lookup. `committing`: the
/// transaction that holds the key was committing when it failed. A commit
/// that failed without the database refusing it
/// ([`BackendRules::commit_rolled_back`]) may have committed:
/// [`Error::OutcomeUnknown`]. A wait for the key, or for SQLite's write
/// lock, that ran out is [`Error::InProgress`].
pub(crate) fn call_error<R: BackendRules, E>(error: Error<E>, committing: bool) -> Error<E> {
    match error {
        Error::Storage(error) if committing && !R::commit_rolled_back(&error) => Error::OutcomeUnknown(error),
        Error::Storage(ref storage) if R::is_in_flight_timeout(storage) => Error::InProgress,
        other => other,
    }
}

/// `value` as the JSON a record stores, refused beyond
/// [`max_response_len`](Config::max_response_len): a call's result, a
/// phased step's output or its final response.
pub(crate) fn stored_json<R: Serialize + DeserializeOwned, E>(config: &Config, value: &R) -> Result<String, Error<E>> {
    let json = codec::to_replayable_json(value).map_err(Error::Codec)?;
    if json.len() > config.max_response_len {
        return Err(Error::ResponseTooLarge {
            len: json.len(),
            max: config.max_response_len,
        });
    }
    Ok(json)
}
