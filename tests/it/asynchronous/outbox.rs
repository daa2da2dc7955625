//! The outbox inside async operations (`outbox::enqueue_async`): a message
//! enqueued by an async call's operation or by an async phased step exists
//! exactly when that transaction commits, carries the call's scope, and is
//! not enqueued again by a replay. Each is checked by what a relay delivers
//! from the database.

use idempotency::outbox::{self, Message, Relay};
use idempotency::phased::{AsyncSteps, Phased};
use idempotency::{Error, run_idempotent_async};

use crate::common::TestDb;
use crate::common::asynchronous::{AsyncDb, async_backend_tests};

async_backend_tests!(
    an_async_call_enqueues_its_message_with_its_commit_and_scope_and_its_replay_enqueues_nothing,
    a_failed_async_operation_leaves_no_message,
    an_async_phased_step_enqueues_with_the_operation_s_scope,
    an_async_envelope_carries_its_headers_and_ordering_key,
);

/// The messages a relay delivers now from `db`: (scope, topic, payload).
fn delivered<D: TestDb>(db: &D) -> Vec<(String, String, String)> {
    let mut conn = db.conn();
    let mut messages = Vec::new();
    tokio::task::block_in_place(|| {
        Relay::default()
            .run_once(&mut conn, |message: &Message| {
                messages.push((
                    message.scope.clone(),
                    message.topic.clone(),
                    message.payload_json.clone(),
                ));
                Ok::<_, std::convert::Infallible>(())
            })
            .expect("a relay's pass")
    });
    messages
}

async fn place<D: AsyncDb>(conn: &mut D::Async, item: &str) -> Result<idempotency::Outcome<i32>, Error<outbox::Error>> {
    run_idempotent_async(conn, "shop", "order-1", &item, async |tx: &mut D::Async| {
        D::insert_order(tx, item).await.map_err(outbox::Error::Storage)?;
        outbox::enqueue_async(tx, "receipts", &item).await?;
        Ok(1)
    })
    .await
}

async fn an_async_call_enqueues_its_message_with_its_commit_and_scope_and_its_replay_enqueues_nothing<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    assert!(!place::<D>(&mut conn, "book").await.expect("the call").is_replayed());
    assert!(place::<D>(&mut conn, "book").await.expect("the retry").is_replayed());
    assert_eq!(
        delivered(&db),
        [("shop".to_owned(), "receipts".to_owned(), "\"book\"".to_owned())],
        "one message, with the call's scope"
    );
}

async fn a_failed_async_operation_leaves_no_message<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let failed = run_idempotent_async(&mut conn, "shop", "order-1", &"book", async |tx: &mut D::Async| {
        outbox::enqueue_async(tx, "receipts", &"book").await?;
        Err::<i32, _>(outbox::Error::Storage(diesel::result::Error::RollbackTransaction))
    })
    .await;
    assert!(matches!(failed, Err(Error::Operation(_))), "{failed:?}");
    let refused = run_idempotent_async(&mut conn, "shop", "order-2", &"book", async |tx: &mut D::Async| {
        outbox::enqueue_async(tx, "no topic", &"book").await
    })
    .await;
    assert!(
        matches!(refused, Err(Error::Operation(outbox::Error::InvalidTopic(_)))),
        "{refused:?}"
    );
    assert_eq!(delivered(&db), [], "nothing to deliver");
    let mut check = db.conn();
    assert_eq!(D::key_count(&mut check), 0, "the keys stay free");
}

async fn an_async_phased_step_enqueues_with_the_operation_s_scope<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    let phased = Phased::new("place-order");
    for _ in 0..2 {
        phased
            .run_async(
                &mut conn,
                "tenant-7",
                "order-1",
                &"book",
                async |s: &mut AsyncSteps<'_, D::Async>| {
                    s.finish(async |tx: &mut D::Async| {
                        outbox::enqueue_async(tx, "receipts", &"book").await?;
                        Ok::<_, outbox::Error>(1)
                    })
                    .await
                },
            )
            .await
            .expect("the operation");
    }
    assert_eq!(
        delivered(&db),
        [("tenant-7".to_owned(), "receipts".to_owned(), "\"book\"".to_owned())]
    );
}

async fn an_async_envelope_carries_its_headers_and_ordering_key<D: AsyncDb>() {
    let db = D::new();
    let mut conn = db.connect().await;
    outbox::Envelope::new("receipts", &"book")
        .header("content-type", "application/json")
        .ordering_key("order-1")
        .enqueue_async(&mut conn)
        .await
        .expect("enqueue");
    let refused = outbox::Envelope::new("receipts", &"book")
        .ordering_key("order 1")
        .enqueue_async(&mut conn)
        .await;
    assert!(
        matches!(refused, Err(outbox::Error::InvalidOrderingKey(_))),
        "{refused:?}"
    );
    let mut check = db.conn();
    let mut seen = Vec::new();
    tokio::task::block_in_place(|| {
        Relay::default()
            .run_once(&mut check, |message: &Message| {
                seen.push((
                    message.header("content-type").map(str::to_owned),
                    message.ordering_key().map(str::to_owned),
                ));
                Ok::<_, std::convert::Infallible>(())
            })
            .expect("a relay's pass")
    });
    assert_eq!(
        seen,
        [(Some("application/json".to_owned()), Some("order-1".to_owned()))],
        "one message, the refused one left nothing"
    );
}
