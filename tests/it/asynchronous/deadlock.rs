//! A deadlock as diesel-async's MySQL client reports it, provoked on the
//! server: two transactions each hold a row the other then asks for, and
//! InnoDB rolls one back. The client reports it as `Unknown` with the
//! server's text, which the crate must still tell retryable, as it does
//! diesel's `SerializationFailure`.

use diesel::sql_types::{BigInt, Unsigned};
use diesel::{ExpressionMethods, QueryDsl, QueryableByName};
use diesel_async::{AsyncConnection, AsyncMysqlConnection, RunQueryDsl, SimpleAsyncConnection};
use idempotency::Error;

use crate::common::asynchronous::AsyncServerDb;
use crate::common::mysql::Db;
use crate::common::wait::PATIENCE;
use crate::common::{TestDb, orders};

/// Whether the server shows session `id`'s transaction waiting for a lock,
/// asked through `admin`.
async fn waits_for_a_row(admin: &mut AsyncMysqlConnection, id: i64) -> bool {
    #[derive(QueryableByName)]
    struct Waiting {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let id = u64::try_from(id).expect("a connection id");
    diesel::sql_query(
        "SELECT count(*) AS n FROM information_schema.innodb_trx \
         WHERE trx_mysql_thread_id = ? AND trx_state = 'LOCK WAIT'",
    )
    .bind::<Unsigned<BigInt>, _>(id)
    .get_result::<Waiting>(admin)
    .await
    .expect("read innodb_trx")
    .n > 0
}

/// Sets the quantity of order `id` through `conn`, which waits for its
/// row's lock if another transaction holds it.
async fn touch(conn: &mut AsyncMysqlConnection, id: i64) -> diesel::QueryResult<usize> {
    diesel::update(orders::table.find(id))
        .set(orders::quantity.eq(orders::quantity + 1))
        .execute(conn)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_as_diesel_async_s_mysql_client_reports_it_is_retryable() {
    let db = Db::new();
    let mut admin = db.conn();
    let ids: Vec<i64> = ["x", "y"]
        .into_iter()
        .map(|item| {
            diesel::RunQueryDsl::execute(
                diesel::insert_into(orders::table).values((orders::item.eq(item), orders::quantity.eq(1))),
                &mut admin,
            )
            .expect("an order");
            diesel::RunQueryDsl::first::<i64>(
                orders::table.filter(orders::item.eq(item)).select(orders::id),
                &mut admin,
            )
            .expect("the order's id")
        })
        .collect();
    let mut first = AsyncMysqlConnection::establish(db.url()).await.expect("a connection");
    let mut second = AsyncMysqlConnection::establish(db.url()).await.expect("a connection");
    for (conn, id) in [(&mut first, ids[0]), (&mut second, ids[1])] {
        conn.batch_execute("BEGIN").await.expect("a transaction");
        assert_eq!(touch(conn, id).await.expect("its own row"), 1);
    }
    let first_session = Db::session_of(&mut first).await;
    let second_row = ids[1];
    let waiting = tokio::spawn(async move {
        let result = touch(&mut first, second_row).await;
        let _ = first.batch_execute("ROLLBACK").await;
        result
    });
    // The first waits for the second's row, as the server shows it; the
    // second then asks for the first's, which closes the cycle.
    let mut watcher = AsyncMysqlConnection::establish(db.url()).await.expect("a connection");
    let deadline = std::time::Instant::now() + PATIENCE;
    while !waits_for_a_row(&mut watcher, first_session).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the first transaction never waited"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let closing = touch(&mut second, ids[0]).await;
    let _ = second.batch_execute("ROLLBACK").await;
    let waited = waiting.await.expect("the waiting task");

    let failures: Vec<diesel::result::Error> = [waited, closing].into_iter().filter_map(Result::err).collect();
    assert_eq!(failures.len(), 1, "InnoDB rolled one transaction back: {failures:?}");
    let deadlock = failures.into_iter().next().expect("one failure");
    let reported = format!("{deadlock:?}");
    assert!(Error::<()>::Storage(deadlock).is_retryable(), "{reported}");
}
