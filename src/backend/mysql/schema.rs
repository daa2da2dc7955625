//! The tables of `migrations/mysql`, as diesel sees them there. The same
//! tables as `crate::schema` but for the type of times: `DATETIME(6)`, which
//! diesel calls `Datetime` on MySQL; its `Timestamp` binds as MySQL's
//! `TIMESTAMP`, whose range ends in 2038.

diesel::table! {
    idempotency_keys (scope, idempotency_key) {
        scope -> Varchar,
        idempotency_key -> Varchar,
        request_hash -> Char,
        status -> Varchar,
        response -> Nullable<Longtext>,
        created_at -> Datetime,
        completed_at -> Nullable<Datetime>,
        expires_at -> Datetime,
        caller_hash -> Nullable<Char>,
        traceparent -> Nullable<Varchar>,
        request_id -> Nullable<Varchar>,
    }
}

diesel::table! {
    idempotency_outbox (id) {
        id -> Varchar,
        topic -> Varchar,
        payload -> Longtext,
        status -> Varchar,
        attempts -> Integer,
        available_at -> Nullable<Datetime>,
        lease_token -> Nullable<Varchar>,
        last_error -> Nullable<Text>,
        created_at -> Datetime,
        delivered_at -> Nullable<Datetime>,
        scope -> Varchar,
        headers -> Nullable<Longtext>,
        ordering_key -> Nullable<Varchar>,
        traceparent -> Nullable<Varchar>,
        tracestate -> Nullable<Varchar>,
    }
}

diesel::table! {
    idempotency_phases (scope, idempotency_key) {
        scope -> Varchar,
        idempotency_key -> Varchar,
        operation -> Text,
        request_hash -> Char,
        request -> Nullable<Longtext>,
        op_id -> Varchar,
        status -> Varchar,
        points -> Longtext,
        response -> Nullable<Longtext>,
        lease_token -> Nullable<Varchar>,
        lease_until -> Nullable<Datetime>,
        attempts -> Integer,
        completer_until -> Nullable<Datetime>,
        last_error -> Nullable<Text>,
        created_at -> Datetime,
        updated_at -> Datetime,
        expires_at -> Nullable<Datetime>,
        caller_hash -> Nullable<Char>,
        traceparent -> Nullable<Varchar>,
        request_id -> Nullable<Varchar>,
    }
}

diesel::allow_tables_to_appear_in_same_query!(idempotency_keys, idempotency_outbox, idempotency_phases,);
