// @generated automatically by Diesel CLI.

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_time::Timestamp;

    idempotency_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
        caller_hash -> Nullable<Text>,
        traceparent -> Nullable<Text>,
        request_id -> Nullable<Text>,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_time::Timestamp;

    idempotency_outbox (id) {
        id -> Text,
        topic -> Text,
        payload -> Text,
        status -> Text,
        attempts -> Integer,
        available_at -> Nullable<Timestamp>,
        lease_token -> Nullable<Text>,
        last_error -> Nullable<Text>,
        created_at -> Timestamp,
        delivered_at -> Nullable<Timestamp>,
        scope -> Text,
        headers -> Nullable<Text>,
        ordering_key -> Nullable<Text>,
        traceparent -> Nullable<Text>,
        tracestate -> Nullable<Text>,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_time::Timestamp;

    idempotency_phases (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        operation -> Text,
        request_hash -> Text,
        request -> Nullable<Text>,
        op_id -> Text,
        status -> Text,
        points -> Text,
        response -> Nullable<Text>,
        lease_token -> Nullable<Text>,
        lease_until -> Nullable<Timestamp>,
        attempts -> Integer,
        completer_until -> Nullable<Timestamp>,
        last_error -> Nullable<Text>,
        created_at -> Timestamp,
        updated_at -> Timestamp,
        expires_at -> Nullable<Timestamp>,
        caller_hash -> Nullable<Text>,
        traceparent -> Nullable<Text>,
        request_id -> Nullable<Text>,
    }
}

diesel::allow_tables_to_appear_in_same_query!(idempotency_keys, idempotency_outbox, idempotency_phases,);
