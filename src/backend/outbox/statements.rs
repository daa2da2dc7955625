//! The outbox's statements that are the same on every backend, each built
//! by a plain function, and sent by a connection's
//! [`OutboxStore`](super::OutboxStore) and
//! [`BlockingOutboxStore`](super::BlockingOutboxStore)
//! (`shared_outbox_statements!`), beside the claim, which is the backend's
//! own; what takes more than one statement or reads what one returned is
//! written once here, over the connection.

use chrono::NaiveDateTime;
use diesel::dsl::{self, min};
use diesel::expression::AsExpression;
use diesel::helper_types::min;
use diesel::prelude::*;

use super::rows::{Backlog, Due, MessageId, NewMessage, Settlement};
use crate::backend::send::{Execute, Load, Sends};
use crate::row_status::MessageStatus;
use crate::schema::idempotency_outbox as o;
use crate::sql_time::{At, Timestamp};

/// `message` inserted, pending and never attempted, created at
/// `created_at`: the backend's clock.
#[dsl::auto_type]
pub(crate) fn new_message<'a, Now: AsExpression<Timestamp>>(message: NewMessage<'a>, created_at: Now) -> _ {
    let pending: MessageStatus = MessageStatus::Pending;
    let never: i32 = 0;
    dsl::insert_into(o::table).values((
        message,
        o::status.eq(pending),
        o::attempts.eq(never),
        o::created_at.eq(created_at),
    ))
}

/// The message `message` while it is pending under the lease `lease_token`.
#[dsl::auto_type]
fn leased<'a>(message: MessageId<'a>, lease_token: &'a str) -> _ {
    let pending: MessageStatus = MessageStatus::Pending;
    let scope: &'a str = message.scope;
    let id: &'a str = message.id;
    o::table
        .filter(o::scope.eq(scope))
        .filter(o::id.eq(id))
        .filter(o::status.eq(pending))
        .filter(o::lease_token.eq(lease_token))
}

/// The leased message recorded as delivered at `at`.
#[dsl::auto_type]
pub(crate) fn delivered<'a>(message: MessageId<'a>, lease_token: &'a str, at: At) -> _ {
    let target: leased<'a> = leased(message, lease_token);
    let status: MessageStatus = MessageStatus::Delivered;
    let no_lease: Option<&'a str> = None;
    dsl::update(target).set((
        o::status.eq(status),
        o::delivered_at.eq(at),
        o::lease_token.eq(no_lease),
    ))
}

/// The leased message due again at `due`, after `error`.
#[dsl::auto_type]
pub(crate) fn retried<'a>(message: MessageId<'a>, lease_token: &'a str, due: At, error: &'a str) -> _ {
    let target: leased<'a> = leased(message, lease_token);
    let no_lease: Option<&'a str> = None;
    dsl::update(target).set((
        o::available_at.eq(due),
        o::last_error.eq(error),
        o::lease_token.eq(no_lease),
    ))
}

/// The leased message parked as dead after `attempts` attempts, the last
/// with `error`.
#[dsl::auto_type]
pub(crate) fn parked<'a>(message: MessageId<'a>, lease_token: &'a str, error: &'a str, attempts: i32) -> _ {
    let target: leased<'a> = leased(message, lease_token);
    let status: MessageStatus = MessageStatus::Dead;
    let no_lease: Option<&'a str> = None;
    dsl::update(target).set((
        o::status.eq(status),
        o::attempts.eq(attempts),
        o::last_error.eq(error),
        o::lease_token.eq(no_lease),
    ))
}

/// The messages `ids` leased under `lease_token` recorded as delivered at
/// `at`.
#[dsl::auto_type]
pub(crate) fn all_delivered<'a>(ids: &'a [String], lease_token: &'a str, at: At) -> _ {
    let pending: MessageStatus = MessageStatus::Pending;
    let status: MessageStatus = MessageStatus::Delivered;
    let no_lease: Option<&'a str> = None;
    dsl::update(
        o::table
            .filter(o::id.eq_any(ids))
            .filter(o::status.eq(pending))
            .filter(o::lease_token.eq(lease_token)),
    )
    .set((
        o::status.eq(status),
        o::delivered_at.eq(at),
        o::lease_token.eq(no_lease),
    ))
}

/// The leased message given back: the attempt it was claimed for undone,
/// due at once.
#[dsl::auto_type]
pub(crate) fn given_back<'a>(message: MessageId<'a>, lease_token: &'a str) -> _ {
    let target: leased<'a> = leased(message, lease_token);
    let one: i32 = 1;
    let at_once: Option<NaiveDateTime> = None;
    let no_lease: Option<&'a str> = None;
    dsl::update(target).set((
        o::attempts.eq(o::attempts - one),
        o::available_at.eq(at_once),
        o::lease_token.eq(no_lease),
    ))
}

/// Whether a pending message was never attempted, or given back.
#[dsl::auto_type]
pub(crate) fn any_fresh() -> _ {
    let pending: MessageStatus = MessageStatus::Pending;
    dsl::select(dsl::exists(
        o::table.filter(o::status.eq(pending)).filter(o::available_at.is_null()),
    ))
}

/// When the earliest pending message is due.
#[dsl::auto_type]
pub(crate) fn earliest_due() -> _ {
    let pending: MessageStatus = MessageStatus::Pending;
    o::table.filter(o::status.eq(pending)).select(min(o::available_at))
}

/// The pending and the dead messages: how many, and the oldest's time.
#[dsl::auto_type]
pub(crate) fn by_status() -> _ {
    let kept: [MessageStatus; 2] = [MessageStatus::Pending, MessageStatus::Dead];
    o::table.filter(o::status.eq_any(kept)).group_by(o::status).select((
        o::status,
        dsl::count_star(),
        min(o::created_at),
    ))
}

/// How many pending messages are due at `now`.
#[dsl::auto_type]
pub(crate) fn due_at(now: At) -> _ {
    let pending: MessageStatus = MessageStatus::Pending;
    o::table
        .filter(o::status.eq(pending))
        .filter(o::available_at.is_null().or(o::available_at.le(now)))
        .count()
}

/// Up to `limit` dead messages, oldest first.
#[dsl::auto_type]
pub(crate) fn dead_list(limit: i64) -> _ {
    let dead: MessageStatus = MessageStatus::Dead;
    o::table.filter(o::status.eq(dead)).order(o::id).limit(limit).select((
        o::id,
        o::topic,
        o::payload,
        o::attempts,
        o::last_error,
        o::created_at,
    ))
}

/// The dead message `id` pending again with fresh attempts, due at once.
#[dsl::auto_type]
pub(crate) fn requeued<'a>(id: &'a str) -> _ {
    let dead: MessageStatus = MessageStatus::Dead;
    let pending: MessageStatus = MessageStatus::Pending;
    let fresh: i32 = 0;
    let at_once: Option<NaiveDateTime> = None;
    let no_lease: Option<&'a str> = None;
    dsl::update(o::table.filter(o::id.eq(id)).filter(o::status.eq(dead))).set((
        o::status.eq(pending),
        o::attempts.eq(fresh),
        o::available_at.eq(at_once),
        o::lease_token.eq(no_lease),
    ))
}

/// [`OutboxStore::settle`](super::OutboxStore::settle).
pub(crate) async fn settle<'a, C>(
    conn: &mut C,
    message: MessageId<'a>,
    lease_token: &'a str,
    settlement: &'a Settlement,
) -> QueryResult<bool>
where
    C: Sends,
    delivered<'a>: Execute<C>,
    retried<'a>: Execute<C>,
    parked<'a>: Execute<C>,
{
    let updated = match settlement {
        Settlement::Delivered { at } => delivered(message, lease_token, At(*at)).send(conn).await?,
        Settlement::Retry { due, error } => retried(message, lease_token, At(*due), error).send(conn).await?,
        Settlement::Dead { error, attempts } => parked(message, lease_token, error, *attempts).send(conn).await?,
    };
    Ok(updated == 1)
}

/// [`OutboxStore::next_due`](super::OutboxStore::next_due).
pub(crate) async fn next_due<C>(conn: &mut C) -> QueryResult<Option<Due>>
where
    C: Sends,
    any_fresh: Load<'static, C, bool>,
    earliest_due: Load<'static, C, Option<NaiveDateTime>>,
{
    // Due whatever the relay's clock says: a claim takes it at once. (Its
    // enqueue time is the database's, which a relay's injected clock may
    // be behind.)
    if any_fresh().fetch(conn).await? {
        return Ok(Some(Due::Now));
    }
    Ok(earliest_due().fetch(conn).await?.map(Due::At))
}

/// [`OutboxStore::backlog`](super::OutboxStore::backlog).
pub(crate) async fn backlog<C>(conn: &mut C, now: NaiveDateTime) -> QueryResult<Backlog>
where
    C: Sends,
    by_status: Load<'static, C, (MessageStatus, i64, Option<NaiveDateTime>)>,
    due_at: Load<'static, C, i64>,
{
    let by_status = by_status().fetch_all(conn).await?;
    let due = due_at(At(now)).fetch(conn).await?;
    let mut backlog = Backlog {
        pending: 0,
        oldest_pending: None,
        due,
        dead: 0,
    };
    for (status, count, oldest) in by_status {
        if status == MessageStatus::Pending {
            backlog.pending = count;
            backlog.oldest_pending = oldest;
        } else {
            backlog.dead = count;
        }
    }
    Ok(backlog)
}

/// [`OutboxStore`](super::OutboxStore)'s statements that every backend
/// shares, given the backend's clock for a new message's `created_at`, and
/// [`BlockingOutboxStore`](super::BlockingOutboxStore)'s (`blocking`), for
/// one connection: each statement built by its function above and sent on
/// the connection, which is one type here, so nothing needs bounds. Holds no
/// SQL.
macro_rules! shared_outbox_statements {
    (created_at = $now:expr) => {
        async fn insert_message(
            &mut self,
            message: &$crate::backend::outbox::NewMessage<'_>,
        ) -> diesel::QueryResult<()> {
            use $crate::backend::send::Execute as _;
            $crate::backend::outbox::statements::new_message(*message, $now)
                .send(self)
                .await?;
            Ok(())
        }

        async fn settle(
            &mut self,
            message: $crate::backend::outbox::MessageId<'_>,
            lease_token: &str,
            settlement: &$crate::backend::outbox::Settlement,
        ) -> diesel::QueryResult<bool> {
            $crate::backend::outbox::statements::settle(self, message, lease_token, settlement).await
        }

        async fn mark_delivered(
            &mut self,
            ids: &[String],
            lease_token: &str,
            at: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use $crate::backend::send::Execute as _;
            let statement =
                $crate::backend::outbox::statements::all_delivered(ids, lease_token, $crate::sql_time::At(at));
            statement.send(self).await
        }

        async fn release(
            &mut self,
            message: $crate::backend::outbox::MessageId<'_>,
            lease_token: &str,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::send::Execute as _;
            let statement = $crate::backend::outbox::statements::given_back(message, lease_token);
            Ok(statement.send(self).await? == 1)
        }

        async fn next_due(&mut self) -> diesel::QueryResult<Option<$crate::backend::outbox::Due>> {
            $crate::backend::outbox::statements::next_due(self).await
        }

        async fn backlog(
            &mut self,
            now: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<$crate::backend::outbox::Backlog> {
            $crate::backend::outbox::statements::backlog(self, now).await
        }
    };
    (blocking) => {
        fn dead_messages(&mut self, limit: usize) -> diesel::QueryResult<Vec<$crate::backend::outbox::DeadRow>> {
            use diesel::RunQueryDsl as _;
            $crate::backend::outbox::statements::dead_list($crate::backend::sql_limit(limit)).load(self)
        }

        fn requeue(&mut self, id: &str) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            Ok($crate::backend::outbox::statements::requeued(id).execute(self)? == 1)
        }
    };
}
pub(crate) use shared_outbox_statements;
