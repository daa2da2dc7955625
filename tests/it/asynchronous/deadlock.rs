//! A deadlock as diesel-async's clients report it, provoked on the server:
//! two transactions each hold a row the other then asks for, and the server
//! rolls one back. PostgreSQL's deadlock (40P01) and diesel-async's MySQL
//! client's (1213) arrive as `Unknown` with the server's text, which the
//! crate must still tell retryable, as it does diesel's
//! `SerializationFailure`.

use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use idempotency::Error;

use crate::common::asynchronous::{AsyncServerDb, async_backend_tests};

async_backend_tests!(server: a_deadlock_as_diesel_async_reports_it_is_retryable);

/// Adds one to the quantity of order `id` through `conn`, which waits for
/// its row's lock while another transaction holds it.
async fn touch<C: AsyncConnection>(conn: &mut C, id: i64) -> diesel::QueryResult<()> {
    conn.batch_execute(&format!("UPDATE orders SET quantity = quantity + 1 WHERE id = {id}"))
        .await
}

async fn a_deadlock_as_diesel_async_reports_it_is_retryable<D: AsyncServerDb>() {
    let db = D::new();
    let mut first = db.connect().await;
    let mut second = db.connect().await;
    // Orders 1 and 2 of the test's fresh table.
    for item in ["x", "y"] {
        D::insert_order(&mut first, item).await.expect("an order");
    }
    for (conn, id) in [(&mut first, 1), (&mut second, 2)] {
        conn.batch_execute("BEGIN").await.expect("a transaction");
        touch(conn, id).await.expect("its own row");
    }
    let waiting = tokio::spawn(async move {
        let result = touch(&mut first, 2).await;
        let _ = first.batch_execute("ROLLBACK").await;
        result
    });
    // Whichever of the two asks first waits for the other's row; the other
    // then closes the cycle, and the server breaks it.
    let closing = touch(&mut second, 1).await;
    let _ = second.batch_execute("ROLLBACK").await;
    let waited = waiting.await.expect("the waiting task");

    let failures: Vec<diesel::result::Error> = [waited, closing].into_iter().filter_map(Result::err).collect();
    assert_eq!(
        failures.len(),
        1,
        "the server rolled one transaction back: {failures:?}"
    );
    let deadlock = failures.into_iter().next().expect("one failure");
    let reported = format!("{deadlock:?}");
    assert!(Error::<()>::Storage(deadlock).is_retryable(), "{reported}");
}
