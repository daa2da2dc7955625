//! Citus: PostgreSQL distributed by tenant. The crate's tables are
//! distributed by `scope` and co-located with the application's tables
//! distributed by their tenant column ([`distribute`]), so that a call's
//! key record, its domain rows and the messages it enqueues live on one
//! shard and its transaction runs on one worker, without a two-phase
//! commit. The guide [Scaling out with Citus](crate::guide::citus) tells the
//! whole deployment.
//!
//! Calls are correct from any node: [`distribute`] makes every call on the
//! database claim its key with an insert that the shard's primary key
//! guards before the operation runs (`idempotency.claim_first`), because
//! the advisory lock that orders calls on one PostgreSQL server only orders
//! the calls of one node.
//!
//! The services' statements differ where Citus refuses PostgreSQL's: a
//! locking read (`FOR UPDATE SKIP LOCKED`) or a `ctid` subquery across
//! shards. Here the relay's claim and the purges first read, without locks
//! and across shards, which scopes have due or expired rows, and then lock
//! and write within one scope at a time, a statement that runs on the
//! scope's shard alone. The PostgreSQL backend takes these forms for a
//! table Citus distributes.

pub(crate) mod outbox;

use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};

use super::expired::Expired;
use crate::backend::{block_on, sql_limit};
use crate::error::Error;

/// The crate's tables, each distributed by `scope`.
const TABLES: [&str; 3] = ["idempotency_keys", "idempotency_phases", "idempotency_outbox"];

/// The database setting that makes every call claim its key before the
/// operation runs; read with the key record, at no extra round trip.
pub(crate) const CLAIM_FIRST: &str = "idempotency.claim_first";

/// Distributes the crate's tables (keys, operations in phases, outbox) by
/// `scope`, co-located with `colocate_with`, a table of the application's
/// already distributed by its tenant column, of type `text`; then a call
/// whose scope is the tenant runs on the tenant's shard.
///
/// Run it once, on the coordinator, after [`run_migrations`](crate::run_migrations)
/// and before the application's pools connect (the setting it writes
/// applies to sessions that start after it). It also:
///
/// - drops the outbox's `NOTIFY` triggers, which Citus does not run on
///   distributed tables (relays there find new messages by polling), and
///   makes `(scope, id)` the outbox's primary key, as Citus requires of a
///   table distributed by `scope`;
/// - sets `idempotency.claim_first` for the database (Citus passes it on to
///   every node), so that calls are correct from any node.
///
/// All of it happens in one transaction, or nothing does. A table already
/// distributed is left as it is, so running it again is harmless. Rows the
/// tables hold are copied to the shards; Citus leaves the local copy on
/// disk until `truncate_local_data_after_distributing_table` removes it.
///
/// # Errors
///
/// [`Error::Storage`] when a statement fails, with nothing changed: the
/// database has no `citus` extension, `colocate_with` is not a distributed
/// table whose distribution column is `text`, or the role may not alter
/// the tables or the database (run it as their owner).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel::connection::SimpleConnection;
/// use diesel::prelude::*;
///
/// let mut conn = PgConnection::establish("postgres://coordinator/shop")?;
/// idempotency::run_migrations(&mut conn)?;
/// conn.batch_execute(
///     "CREATE TABLE orders (account TEXT NOT NULL, id BIGSERIAL, PRIMARY KEY (account, id));
///      SELECT create_distributed_table('orders', 'account');",
/// )?;
/// idempotency::citus::distribute(&mut conn, "orders")?;
/// # Ok(())
/// # }
/// ```
pub fn distribute(conn: &mut PgConnection, colocate_with: &str) -> Result<(), Error> {
    // One transaction: a table Citus refuses to co-locate with leaves the
    // crate's tables as they were.
    conn.transaction(|conn| {
        if !distributed(conn, "idempotency_outbox")? {
            // Each its own statement: Citus refuses DDL on distributed
            // tables in a string of several.
            conn.batch_execute("DROP TRIGGER IF EXISTS idempotency_outbox_announce_insert ON idempotency_outbox")?;
            conn.batch_execute("DROP TRIGGER IF EXISTS idempotency_outbox_announce_requeue ON idempotency_outbox")?;
            conn.batch_execute(
                "ALTER TABLE idempotency_outbox DROP CONSTRAINT idempotency_outbox_pkey, ADD PRIMARY KEY (scope, id)",
            )?;
        }
        for table in TABLES {
            if !distributed(conn, table)? {
                diesel::sql_query("SELECT create_distributed_table($1::regclass, 'scope', colocate_with => $2)")
                    .bind::<Text, _>(table)
                    .bind::<Text, _>(colocate_with)
                    .execute(conn)?;
            }
        }
        conn.batch_execute(&format!(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET {CLAIM_FIRST} = on', current_database()); END $$"
        ))?;
        Ok(())
    })
}

/// [`distributed`](super::sql::distributed) on a synchronous connection,
/// whose statements complete as they are sent.
///
/// # Errors
///
/// The database error when the catalog cannot be read.
pub(crate) fn distributed(conn: &mut PgConnection, table: &str) -> QueryResult<bool> {
    block_on(super::session::distributed(conn, table))
}

/// `postgres::purge` on a distributed table: the scopes with expired rows
/// are read across shards without locks, and each scope's rows are then
/// deleted (or updated, with [`Expired::set`]) by a statement on its shard,
/// passing over rows a live transaction holds, until `limit` rows are
/// deleted.
pub(crate) fn purge(conn: &mut PgConnection, expired: &Expired<'_>, limit: usize) -> QueryResult<usize> {
    #[derive(QueryableByName)]
    struct Scope {
        #[diesel(sql_type = Text)]
        scope: String,
    }
    let Expired {
        table, key, condition, ..
    } = expired;
    let (scope, left) = (expired.next_parameter(), expired.next_parameter() + 1);
    let scopes: Vec<Scope> = expired
        .query(format!(
            "SELECT DISTINCT scope FROM {table} WHERE {condition} LIMIT ${scope}"
        ))
        .bind::<BigInt, _>(sql_limit(limit))
        .load(conn)?;
    let delete = format!(
        "{} WHERE scope = ${scope} AND {key} IN \
         (SELECT {key} FROM {table} WHERE scope = ${scope} AND {condition} LIMIT ${left} FOR UPDATE SKIP LOCKED)",
        expired.head()
    );
    let mut deleted = 0;
    for Scope { scope } in scopes {
        if deleted >= limit {
            break;
        }
        deleted += expired
            .query(delete.clone())
            .bind::<Text, _>(scope)
            .bind::<BigInt, _>(sql_limit(limit - deleted))
            .execute(conn)?;
    }
    Ok(deleted)
}
