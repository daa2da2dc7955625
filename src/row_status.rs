//! The states a stored row is in: the values of the `status` columns of the
//! crate's tables, as types. Each is stored as the text it has always been
//! stored as, so the migrations and the rows already stored stay as they
//! are; a value that is none of a column's states fails to decode with an
//! error that names it, never with a panic.

use diesel::backend::Backend;
use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::expression::AsExpression;
use diesel::serialize::{self, Output, ToSql};
use diesel::sql_types::Text;

/// The state of a key record (`idempotency_keys.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, AsExpression, FromSqlRow)]
#[diesel(sql_type = Text)]
pub enum RecordStatus {
    /// Claimed before the operation ran: no response yet.
    Processing,
    /// Written with the operation's response.
    Completed,
}

impl RecordStatus {
    const ALL: [Self; 2] = [Self::Processing, Self::Completed];

    /// The text the state is stored as.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "processing",
            Self::Completed => "completed",
        }
    }
}

/// The state of an outbox message (`idempotency_outbox.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, AsExpression, FromSqlRow)]
#[diesel(sql_type = Text)]
pub enum MessageStatus {
    /// Waiting for a relay to deliver it.
    Pending,
    /// Accepted by a handler.
    Delivered,
    /// Given up after its attempts, until a person requeues it.
    Dead,
}

impl MessageStatus {
    const ALL: [Self; 3] = [Self::Pending, Self::Delivered, Self::Dead];

    fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Delivered => "delivered",
            Self::Dead => "dead",
        }
    }
}

/// The state of an operation in phases (`idempotency_phases.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, AsExpression, FromSqlRow)]
#[diesel(sql_type = Text)]
pub enum OperationStatus {
    /// Started, not finished: an attempt or a completer carries it on.
    Running,
    /// Finished with its response.
    Completed,
    /// Given up, until a person requeues it.
    Parked,
}

impl OperationStatus {
    const ALL: [Self; 3] = [Self::Running, Self::Completed, Self::Parked];

    fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Parked => "parked",
        }
    }
}

/// The state among `all` stored as `text` in `column`, or a decode error
/// that names the value and the column.
fn parse<S: Copy>(all: &[S], as_str: fn(S) -> &'static str, column: &str, text: &str) -> deserialize::Result<S> {
    all.iter()
        .copied()
        .find(|status| as_str(*status) == text)
        .ok_or_else(|| format!("{column} holds {text:?}, which is not one of its states").into())
}

/// Stores the state type `$status` as the text of its `as_str`, and reads it
/// back as one of its `ALL` states, on every backend that stores text;
/// `$column` names the column in a decode error.
macro_rules! stored_as_text {
    ($status:ty, $column:literal) => {
        impl<DB: Backend> ToSql<Text, DB> for $status
        where
            str: ToSql<Text, DB>,
        {
            fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, DB>) -> serialize::Result {
                self.as_str().to_sql(out)
            }
        }

        impl<DB: Backend> FromSql<Text, DB> for $status
        where
            String: FromSql<Text, DB>,
        {
            fn from_sql(bytes: DB::RawValue<'_>) -> deserialize::Result<Self> {
                parse(&Self::ALL, Self::as_str, $column, &String::from_sql(bytes)?)
            }
        }
    };
}

stored_as_text!(RecordStatus, "idempotency_keys.status");
stored_as_text!(MessageStatus, "idempotency_outbox.status");
stored_as_text!(OperationStatus, "idempotency_phases.status");

#[cfg(test)]
mod tests {
    use super::{MessageStatus, OperationStatus, RecordStatus, parse};

    #[test]
    fn the_stored_texts_are_pinned() {
        // Rows already stored hold these texts; they may never change.
        assert_eq!(RecordStatus::ALL.map(RecordStatus::as_str), ["processing", "completed"]);
        assert_eq!(
            MessageStatus::ALL.map(MessageStatus::as_str),
            ["pending", "delivered", "dead"]
        );
        assert_eq!(
            OperationStatus::ALL.map(OperationStatus::as_str),
            ["running", "completed", "parked"]
        );
    }

    #[test]
    fn an_unknown_state_is_a_decode_error_that_names_it() {
        let error = parse(
            &MessageStatus::ALL,
            MessageStatus::as_str,
            "idempotency_outbox.status",
            "lost",
        )
        .expect_err("not a state");
        assert_eq!(
            error.to_string(),
            "idempotency_outbox.status holds \"lost\", which is not one of its states"
        );
        assert_eq!(
            parse(
                &MessageStatus::ALL,
                MessageStatus::as_str,
                "idempotency_outbox.status",
                "dead"
            )
            .ok(),
            Some(MessageStatus::Dead)
        );
    }
}
