//! The OpenAPI document of `examples/openapi_orders.rs`, as the example
//! binary serves it (`cargo test` builds it beside the tests): equal to the
//! one checked in beside this file, naming the header, the problems and the
//! replay marker, and describing a service that places and looks up an
//! order.

use serde_json::{Value, json};

use crate::common::http::{Answer, ExampleProcess, Launch, client, post_order, send};

/// The document as checked in. After a deliberate change, write the new
/// one with `curl http://127.0.0.1:8080/openapi.json | python3 -m json.tool`
/// from the running example.
const CHECKED_IN: &str = include_str!("openapi_orders.json");

/// The example, serving on a port of its own.
async fn example() -> ExampleProcess {
    ExampleProcess::start_example("openapi_orders", vec![String::from("127.0.0.1:0")], Launch::default()).await
}

/// The document the example serves.
async fn served_spec(service: &ExampleProcess) -> Value {
    let answer = send(client().get(format!("{}/openapi.json", service.base))).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    answer.body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_spec_is_the_checked_in_one() {
    let service = example().await;
    let checked_in: Value = serde_json::from_str(CHECKED_IN).expect("JSON");
    assert_eq!(
        served_spec(&service).await,
        checked_in,
        "the spec changed; see CHECKED_IN"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spec_names_the_header_the_problems_and_the_replay_marker() {
    let spec = served_spec(&example().await).await;
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
    let service = example().await;
    let client = client();
    let placed: Answer = send(post_order(
        &client,
        &service.base,
        "acct-1",
        &["o-1"],
        r#"{"item": "book", "quantity": 2}"#,
    ))
    .await;
    assert_eq!(placed.status, 201, "{placed:?}");
    let found = send(
        client
            .get(format!("{}/orders/status", service.base))
            .bearer_auth("acct-1")
            .header("idempotency-key", "o-1"),
    )
    .await;
    assert_eq!(found.status, 201, "{found:?}");
    assert_eq!(found.replayed.as_deref(), Some("true"));
    assert_eq!(found.body, placed.body, "the order as first answered");
}
