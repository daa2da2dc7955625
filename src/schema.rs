// @generated automatically by Diesel CLI.

diesel::table! {
    idempotency_keys (scope, idempotency_key) {
        scope -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        status -> Text,
        response -> Nullable<Text>,
        created_at -> Timestamp,
        completed_at -> Nullable<Timestamp>,
        expires_at -> Timestamp,
    }
}
