//! The async call against callers that get it wrong and a network that
//! goes silent: keys and scopes the rules refuse, a result beyond the
//! response limit, and a caller that holds a key and then says nothing
//! more, never closing its connection. Each is checked against what the
//! database holds.

use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency::{Config, Error, Outcome};

use super::{order_a_book, orders_and_keys};
use crate::common::asynchronous::{AsyncDb, async_backend_tests};

async_backend_tests!(
    an_async_call_refuses_keys_and_scopes_the_rules_refuse_and_writes_nothing,
    an_async_result_beyond_the_response_limit_rolls_back_and_leaves_the_key_free,
);

async fn an_async_call_refuses_keys_and_scopes_the_rules_refuse_and_writes_nothing<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let runs = AtomicUsize::new(0);
    let long = "k".repeat(300);
    let cases: [(&str, &str); 6] = [
        ("shop", ""),
        ("shop", "two words"),
        ("shop", "k\u{e9}y"),
        ("shop", &long),
        ("shop", "4111111111111111"),
        ("", "order-1"),
    ];
    for (scope, key) in cases {
        let refused = order_a_book::<D>(&mut conn, (scope, key), &runs, 1).await;
        match (scope.is_empty(), &refused) {
            (true, Err(Error::InvalidScope(_))) | (false, Err(Error::InvalidKey(_))) => {}
            _ => panic!("{scope:?} / {key:?}: {refused:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no refused call ran its operation");
    assert_eq!(orders_and_keys(&db), (0, 0));
}

async fn an_async_result_beyond_the_response_limit_rolls_back_and_leaves_the_key_free<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let config = Config::default().max_response_len(64);
    let too_large = config
        .run_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut D::Async| {
            D::insert_order(tx, "book").await?;
            Ok::<_, diesel::result::Error>("x".repeat(1_000))
        })
        .await;
    assert!(
        matches!(too_large, Err(Error::ResponseTooLarge { max: 64, .. })),
        "{too_large:?}"
    );
    assert_eq!(orders_and_keys(&db), (0, 0), "rolled back");
    let retried = config
        .run_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut D::Async| {
            D::insert_order(tx, "book").await?;
            Ok::<_, diesel::result::Error>(String::from("order 1"))
        })
        .await;
    assert_eq!(retried.expect("the retry"), Outcome::Executed(String::from("order 1")));
}

/// The server backends' test, in a module of its own: the macro names its
/// modules by backend.
mod silent {
    use chrono::Duration;
    use idempotency::{Config, InFlight, Outcome};

    use crate::common::asynchronous::{AsyncServerDb, async_backend_tests};

    async_backend_tests!(server: a_silent_async_caller_loses_its_key_within_the_idle_bound);

    /// A caller whose operation has written and then waits for ever, its
    /// connection open and silent, as a host cut off from the network leaves
    /// it: the server ends the session after the idle bound, which frees the
    /// key, and a call waiting for the key executes; nothing of the silent
    /// call stays.
    async fn a_silent_async_caller_loses_its_key_within_the_idle_bound<D: AsyncServerDb>() {
        let db = D::new();
        let (inside_tx, inside) = tokio::sync::oneshot::channel();
        let silent_config = Config::default().idle_timeout(Duration::seconds(1));
        let mut silent_conn = db.connect().await;
        let silent = silent_config.run_async(
            &mut silent_conn,
            "shop",
            "order-1",
            &"book",
            async |tx: &mut D::Async| {
                D::insert_order(tx, "silent").await?;
                inside_tx.send(()).expect("the test waits");
                std::future::pending::<()>().await;
                Ok::<_, diesel::result::Error>(0)
            },
        );
        let mut conn = db.connect().await;
        let waiter = async {
            inside.await.expect("the silent call holds the key");
            Config::default()
                .in_flight(InFlight::Wait(Duration::seconds(20)))
                .run_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut D::Async| {
                    D::insert_order(tx, "book").await?;
                    Ok::<_, diesel::result::Error>(1)
                })
                .await
        };
        // The silent call is polled until the waiter is answered, and never
        // ends: only the server can free its key.
        let answered = tokio::select! {
            _ = silent => panic!("the silent call never ends by itself"),
            answered = waiter => answered,
        };
        assert_eq!(answered.expect("the waiter is served"), Outcome::Executed(1));
        let mut check = db.conn();
        assert_eq!(D::order_items(&mut check), ["book"], "nothing of the silent call stays");
    }
}
