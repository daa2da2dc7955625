//! The OpenAPI document of `examples/openapi_orders.rs`: served by the
//! example's router, equal to the one checked in beside this file, and
//! naming the header, the problems and the replay marker.

use axum::http::{Request, StatusCode};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::common::http::seen;
use crate::openapi_orders;

/// The document as checked in. After a deliberate change, write the new
/// one with `curl http://127.0.0.1:8080/openapi.json | python3 -m json.tool`
/// from the running example.
const CHECKED_IN: &str = include_str!("openapi_orders.json");

async fn get(app: &axum::Router, path: &str) -> (StatusCode, Value) {
    let request = Request::get(path).body(axum::body::Body::empty()).expect("a request");
    let seen = seen(app, request).await;
    (seen.status, seen.json())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_spec_is_the_checked_in_one() {
    let db = idempotency::testing::SqliteFile::new();
    let app = openapi_orders::app(db.path().to_str().expect("utf-8 path")).expect("the service");
    let (status, served) = get(&app, "/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let checked_in: Value = serde_json::from_str(CHECKED_IN).expect("JSON");
    assert_eq!(served, checked_in, "the spec changed; see CHECKED_IN");
}

#[test]
fn the_spec_names_the_header_the_problems_and_the_replay_marker() {
    let spec = serde_json::to_value(openapi_orders::spec()).expect("JSON");
    for (path, method, success) in [("/orders", "post", "201"), ("/orders/status", "get", "201")] {
        let operation = &spec["paths"][path][method];
        let parameters = operation["parameters"].as_array().expect("parameters");
        assert!(
            parameters
                .iter()
                .any(|p| p["name"] == "Idempotency-Key" && p["in"] == "header" && p["required"] == true),
            "{path}: {parameters:?}"
        );
        let responses = &operation["responses"];
        assert_eq!(
            responses[success]["headers"]["Idempotent-Replayed"]["schema"],
            json!({"type": "boolean"}),
            "{path}"
        );
        assert_eq!(
            responses[success]["headers"]["Idempotency-Expires"]["schema"],
            json!({"type": "string"}),
            "{path}"
        );
        for status in ["400", "409", "500", "503"] {
            assert_eq!(
                responses[status]["content"]["application/problem+json"]["schema"]["$ref"],
                "#/components/schemas/Problem",
                "{path} {status}"
            );
        }
        assert!(responses["409"]["headers"]["Retry-After"].is_object(), "{path}");
        assert!(responses["400"]["headers"].get("Idempotent-Replayed").is_none());
        assert!(responses["400"]["headers"].get("Idempotency-Expires").is_none());
    }
    assert!(spec["paths"]["/orders"]["post"]["responses"]["422"].is_object());
    assert!(spec["paths"]["/orders/status"]["get"]["responses"]["404"].is_object());
    assert!(spec["paths"]["/orders/status"]["get"]["responses"]["410"].is_object());
    let problem = &spec["components"]["schemas"]["Problem"];
    assert_eq!(problem["required"], json!(["type", "title", "status"]));
    assert_eq!(problem["properties"]["retryable"]["type"], "boolean");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_service_places_and_looks_up_an_order() {
    let db = idempotency::testing::SqliteFile::new();
    let app = openapi_orders::app(db.path().to_str().expect("utf-8 path")).expect("the service");
    let post = Request::post("/orders")
        .header("authorization", "Bearer acct-1")
        .header("idempotency-key", "o-1")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(r#"{"item": "book", "quantity": 2}"#))
        .expect("a request");
    let placed = app.clone().oneshot(post).await.expect("infallible");
    assert_eq!(placed.status(), StatusCode::CREATED);
    let status = Request::get("/orders/status")
        .header("authorization", "Bearer acct-1")
        .header("idempotency-key", "o-1")
        .body(axum::body::Body::empty())
        .expect("a request");
    let found = app.clone().oneshot(status).await.expect("infallible");
    assert_eq!(found.status(), StatusCode::CREATED);
    assert_eq!(found.headers()["idempotent-replayed"], "true");
}
