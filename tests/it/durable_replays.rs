//! Durable replays against a server whose synchronous standby never
//! answers (`synchronous_standby_names` names one that does not exist): a
//! commit that wrote to the log waits there until the standby requirement
//! is lifted. A durable replay is seen waiting; an ordinary replay is not.

use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::Integer;
use idempotency::{Config, Outcome};

use crate::common::pg::{activity, backend_pid};
use crate::common::pg_cluster::Cluster;
use crate::common::wait::PATIENCE;

fn connect(url: &str) -> PgConnection {
    PgConnection::establish(url).expect("connect to the test's cluster")
}

/// A session whose commits do not wait for the standby.
fn local_commits(url: &str) -> PgConnection {
    let mut conn = connect(url);
    conn.batch_execute("SET synchronous_commit = local")
        .expect("commit locally");
    conn
}

fn wait_event(admin: &mut PgConnection, pid: i32) -> Option<String> {
    activity(admin, pid, "wait_event").filter(|event| !event.is_empty())
}

/// Ends a backend when dropped, so that a failed assertion does not leave
/// the test waiting for a thread whose commit waits for the standby.
struct Terminate<'a> {
    url: &'a str,
    pid: i32,
}

impl Drop for Terminate<'_> {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(self.url) {
            let _ = diesel::sql_query("SELECT pg_terminate_backend($1)")
                .bind::<Integer, _>(self.pid)
                .execute(&mut conn);
        }
    }
}

#[test]
fn durable_replay_answers_once_the_synchronous_standby_has_the_record() {
    let cluster = Cluster::with(&["synchronous_standby_names = 'nobody'"]);
    let url = cluster.url();
    let mut admin = local_commits(&url);
    idempotency::run_migrations(&mut admin).expect("migrate");
    let config = Config::default();
    let first = config
        .run(&mut local_commits(&url), "orders", "k-1", &"book", |_| {
            Ok::<_, String>(7)
        })
        .expect("executes");
    assert_eq!(first, Outcome::Executed(7));

    // Reads only, so nothing to wait for.
    let ordinary = config
        .run(&mut connect(&url), "orders", "k-1", &"book", |_| Ok::<_, String>(0))
        .expect("replays");
    assert_eq!(ordinary, Outcome::Replayed(7));

    let durable = config.durable_replays(true);
    let mut replayer = connect(&url);
    let pid = backend_pid(&mut replayer);
    thread::scope(|scope| {
        let _unblock = Terminate { url: &url, pid };
        let replay = scope.spawn(move || durable.run(&mut replayer, "orders", "k-1", &"book", |_| Ok::<_, String>(0)));
        let deadline = Instant::now() + PATIENCE;
        while wait_event(&mut admin, pid).as_deref() != Some("SyncRep") {
            assert!(
                !replay.is_finished(),
                "the durable replay answered without waiting for the standby"
            );
            assert!(
                Instant::now() < deadline,
                "the durable replay never waited for the standby"
            );
            thread::sleep(Duration::from_millis(10));
        }
        admin
            .batch_execute("ALTER SYSTEM SET synchronous_standby_names = ''")
            .expect("lift the standby requirement");
        admin.batch_execute("SELECT pg_reload_conf()").expect("reload");
        let replay = replay.join().expect("the replay does not panic");
        assert_eq!(replay.expect("replays"), Outcome::Replayed(7));
    });
}
