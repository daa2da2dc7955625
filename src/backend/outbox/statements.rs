//! The outbox statements whose DSL is the same on every backend (see
//! `keys/statements.rs` for why a macro rather than generic functions).

/// The outbox's statements for the tables of a schema module, naming
/// each method it takes:
///
/// - `outbox_statements!(ready schema, created_at = now; insert_message, settle, ...)`:
///   the methods `insert_message`, `settle`, `mark_delivered`, `release`,
///   `next_due` and `backlog` of
///   [`OutboxStore`](super::OutboxStore) as the `async fn`s of a
///   synchronous connection, whose statements complete as they are sent,
///   given the backend's expression for the database's time;
/// - `outbox_statements!(async schema, created_at = now; ...)`: the same,
///   awaited, for a diesel-async connection;
/// - `outbox_statements!(blocking schema; dead_messages, ...)`: the methods
///   `dead_messages` and `requeue` of
///   [`BlockingOutboxStore`](super::BlockingOutboxStore).
macro_rules! outbox_statements {
    (async $schema:ident, created_at = $now:expr; $($method:ident),+ $(,)?) => {
        $($crate::backend::outbox::outbox_statements!(@$method $schema, $now, [async] [.await] [diesel_async::RunQueryDsl]);)+
    };
    (ready $schema:ident, created_at = $now:expr; $($method:ident),+ $(,)?) => {
        $($crate::backend::outbox::outbox_statements!(@$method $schema, $now, [async] [] [diesel::RunQueryDsl]);)+
    };
    (blocking $schema:ident; $($method:ident),+ $(,)?) => {
        $($crate::backend::outbox::outbox_statements!(@$method $schema, (), [] [] [diesel::RunQueryDsl]);)+
    };
    (@insert_message $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn insert_message(&mut self, message: &$crate::backend::outbox::rows::NewMessage<'_>) -> diesel::QueryResult<()> {
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::ExpressionMethods;
            use $($run)* as _;
            diesel::insert_into(o::table)
                .values((
                    o::id.eq(message.id),
                    o::scope.eq(message.scope),
                    o::topic.eq(message.topic),
                    o::payload.eq(message.payload),
                    o::status.eq(MessageStatus::Pending),
                    o::attempts.eq(0),
                    o::available_at.eq(message.not_before),
                    o::created_at.eq($now),
                    o::headers.eq(message.headers),
                    o::ordering_key.eq(message.ordering_key),
                    o::traceparent.eq(message.traceparent),
                    o::tracestate.eq(message.tracestate),
                ))
                .execute(self)$($await)*?;
            Ok(())
        }
    };
    (@settle $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn settle(
            &mut self,
            message: $crate::backend::outbox::rows::MessageId<'_>,
            lease_token: &str,
            settlement: &$crate::backend::outbox::rows::Settlement,
        ) -> diesel::QueryResult<bool> {
            use $crate::backend::outbox::rows::Settlement;
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let held = o::table
                .filter(o::scope.eq(message.scope))
                .filter(o::id.eq(message.id))
                .filter(o::status.eq(MessageStatus::Pending))
                .filter(o::lease_token.eq(lease_token));
            let updated = match settlement {
                Settlement::Delivered { at } => diesel::update(held)
                    .set((
                        o::status.eq(MessageStatus::Delivered),
                        o::delivered_at.eq(at),
                        o::lease_token.eq(None::<String>),
                    ))
                    .execute(self)$($await)*?,
                Settlement::Retry { due, error } => diesel::update(held)
                    .set((
                        o::available_at.eq(due),
                        o::last_error.eq(error),
                        o::lease_token.eq(None::<String>),
                    ))
                    .execute(self)$($await)*?,
                Settlement::Dead { error, attempts } => diesel::update(held)
                    .set((
                        o::status.eq(MessageStatus::Dead),
                        o::attempts.eq(attempts),
                        o::last_error.eq(error),
                        o::lease_token.eq(None::<String>),
                    ))
                    .execute(self)$($await)*?,
            };
            Ok(updated == 1)
        }
    };
    (@mark_delivered $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn mark_delivered(
            &mut self,
            ids: &[String],
            lease_token: &str,
            at: chrono::NaiveDateTime,
        ) -> diesel::QueryResult<usize> {
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            diesel::update(
                o::table
                    .filter(o::id.eq_any(ids))
                    .filter(o::status.eq(MessageStatus::Pending))
                    .filter(o::lease_token.eq(lease_token)),
            )
            .set((
                o::status.eq(MessageStatus::Delivered),
                o::delivered_at.eq(at),
                o::lease_token.eq(None::<String>),
            ))
            .execute(self)$($await)*
        }
    };
    (@dead_messages $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn dead_messages(&mut self, limit: usize) -> diesel::QueryResult<Vec<$crate::backend::outbox::rows::DeadRow>> {
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            o::table
                .filter(o::status.eq(MessageStatus::Dead))
                .order(o::id)
                .limit($crate::backend::sql_limit(limit))
                .select((
                    o::id,
                    o::topic,
                    o::payload,
                    o::attempts,
                    o::last_error,
                    o::created_at,
                ))
                .load(self)$($await)*
        }
    };
    (@release $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn release(
            &mut self,
            message: $crate::backend::outbox::rows::MessageId<'_>,
            lease_token: &str,
        ) -> diesel::QueryResult<bool> {
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let released = o::table
                .filter(o::scope.eq(message.scope))
                .filter(o::id.eq(message.id))
                .filter(o::status.eq(MessageStatus::Pending))
                .filter(o::lease_token.eq(lease_token));
            let updated = diesel::update(released)
                .set((
                    o::attempts.eq(o::attempts - 1),
                    o::available_at.eq(None::<chrono::NaiveDateTime>),
                    o::lease_token.eq(None::<String>),
                ))
                .execute(self)$($await)*?;
            Ok(updated == 1)
        }
    };
    (@next_due $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn next_due(&mut self) -> diesel::QueryResult<Option<$crate::backend::outbox::rows::Due>> {
            use $crate::backend::outbox::rows::Due;
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let pending = o::table.filter(o::status.eq(MessageStatus::Pending));
            // Due whatever the relay's clock says: a claim takes it at once.
            // (Its enqueue time is the database's, which a relay's injected
            // clock may be behind.)
            let fresh = diesel::select(diesel::dsl::exists(pending.filter(o::available_at.is_null())));
            if fresh.get_result(self)$($await)*? {
                return Ok(Some(Due::Now));
            }
            let earliest: Option<chrono::NaiveDateTime> =
                pending.select(diesel::dsl::min(o::available_at)).get_result(self)$($await)*?;
            Ok(earliest.map(Due::At))
        }
    };
    (@backlog $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn backlog(&mut self, now: chrono::NaiveDateTime) -> diesel::QueryResult<$crate::backend::outbox::rows::Backlog> {
            use $crate::backend::outbox::rows::Backlog;
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::{BoolExpressionMethods, ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let by_status: Vec<($crate::row_status::MessageStatus, i64, Option<chrono::NaiveDateTime>)> = o::table
                .filter(o::status.eq_any([MessageStatus::Pending, MessageStatus::Dead]))
                .group_by(o::status)
                .select((
                    o::status,
                    diesel::dsl::count_star(),
                    diesel::dsl::min(o::created_at),
                ))
                .load(self)$($await)*?;
            let due = o::table
                .filter(o::status.eq(MessageStatus::Pending))
                .filter(o::available_at.is_null().or(o::available_at.le(now)))
                .count()
                .get_result(self)$($await)*?;
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
    };
    (@requeue $schema:ident, $now:expr, [$($async:tt)?] [$($await:tt)*] [$($run:tt)*]) => {
        $($async)? fn requeue(&mut self, id: &str) -> diesel::QueryResult<bool> {
            use $crate::row_status::MessageStatus;
            use $schema::idempotency_outbox as o;
            use diesel::{ExpressionMethods, QueryDsl};
            use $($run)* as _;
            let updated = diesel::update(o::table.filter(o::id.eq(id)).filter(o::status.eq(MessageStatus::Dead)))
                .set((
                    o::status.eq(MessageStatus::Pending),
                    o::attempts.eq(0),
                    o::available_at.eq(None::<chrono::NaiveDateTime>),
                    o::lease_token.eq(None::<String>),
                ))
                .execute(self)$($await)*?;
            Ok(updated == 1)
        }
    };
}
pub(crate) use outbox_statements;
