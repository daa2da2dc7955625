//! A process killed at every boundary of the operation, then resumed by
//! a client's retry and by the completer.

use super::*;

/// What the child prints once it stands at the boundary it is killed at.
const CHILD_READY: &str = "phased-child-ready";

/// A kill test per boundary, each a [`killed_at`] under its own name, the
/// name its child process runs it by.
macro_rules! killed_at_every_boundary {
    ($($test:ident: $boundary:ident),+ $(,)?) => {
        crate::common::backend_tests!($($test),+);
        $(
            fn $test<D: RideDb>() {
                killed_at::<D>(Boundary::$boundary, stringify!($test));
            }
        )+
    };
}

killed_at_every_boundary!(
    killed_inside_the_first_phase_leaves_the_key_free: InsideFirstPhase,
    killed_after_the_first_phase_resumes_once: AfterFirstPhase,
    killed_before_the_call_calls_the_provider_once: BeforeCall,
    killed_after_the_provider_applied_charges_once: AfterProviderApplied,
    killed_inside_finish_sends_one_receipt: InsideFinish,
    killed_after_finish_replays_the_reply: AfterFinish,
);

/// The operation of the kill tests: a lease short enough that the parent
/// takes over soon after the kill, and the wait for it long enough to.
fn killable() -> Phased {
    Phased::new(OPERATION)
        .store_requests(true)
        .lease(Duration::seconds(1))
        .config(Config::default().in_flight(InFlight::Wait(Duration::seconds(20))))
}

/// The child: runs the operation as a server process would, and at
/// `boundary` says so and waits to be killed.
fn crashing_child<D: RideDb>(url: &str, boundary: Boundary) {
    let db_pool = D::pool_at(url, 1);
    let mut conn = db_pool.get().expect("the child's connection");
    let rides = Rides::<D> {
        phased: killable(),
        provider: Arc::new(Provider::new(url)),
    };
    let stop = |reached: Boundary| {
        if reached == boundary {
            report_and_wait_for_the_kill(CHILD_READY);
        }
    };
    let result = rides.create_stopping(&mut conn, KEY, &ada(), &stop);
    panic!("the child went past {boundary:?}: {result:?}");
}

/// Runs test `test` again as a child process on `db`, and kills it with
/// SIGKILL once it stands at its boundary.
fn kill_child_at_its_boundary<D: RideDb>(db: &D, test: &str) {
    let test = crate::common::test_name::<D>(module_path!(), test);
    let mut child = Child::start(&test, db.url());
    child.wait_for("its boundary", |line| (line == CHILD_READY).then_some(()));
    let status = child.kill();
    assert_eq!(status.signal(), Some(9), "the child was killed, not finished: {status}");
}

/// Passes of `completer` until one picks the operation, which that pass must
/// finish: meanwhile the killed attempt's lease runs out, and passes find
/// nothing to do.
fn complete_once<D: RideDb>(completer: &Completer<D::Conn>, conn: &mut D::Conn) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let report = completer.run_once(conn).expect("a completer pass");
        if report.picked > 0 {
            assert_eq!(counts(&report), (1, 1, 0, 0, 0), "one operation picked and finished");
            return;
        }
        assert_eq!(report, Completions::default(), "nothing is done while the lease runs");
        assert!(Instant::now() < deadline, "the killed attempt's lease never ran out");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The recovery points a process killed at `boundary` leaves behind.
fn left_behind(boundary: Boundary) -> Option<Vec<String>> {
    let points: &[&str] = match boundary {
        Boundary::InsideFirstPhase => return None,
        Boundary::AfterFirstPhase => &["ride_created"],
        Boundary::BeforeCall | Boundary::AfterProviderApplied => &["ride_created", "charged (started)"],
        Boundary::InsideFinish => &["ride_created", "charged"],
        Boundary::AfterFinish => &["completed"],
    };
    Some(points.iter().map(|point| point.to_string()).collect())
}

/// The kill test of `boundary`, named `test`: kills a child there, then
/// resumes once by a client's retry and, on a second database, once by the
/// completer. Each way ends with one ride, charged once, one receipt and
/// the same reply on every retry.
fn killed_at<D: RideDb>(boundary: Boundary, test: &str) {
    if let Some(url) = parent_database() {
        return crashing_child::<D>(&url, boundary);
    }
    // Only a kill after the provider answered leaves a request to repeat;
    // a kill after the call's result committed leaves none to make.
    let requests = if boundary == Boundary::AfterProviderApplied {
        2
    } else {
        1
    };
    let requests_here = match boundary {
        Boundary::InsideFinish | Boundary::AfterFinish => 0,
        _ => 1,
    };
    // Without a commit there was nothing to take over; once finished,
    // nothing to resume.
    let attempts_made = match boundary {
        Boundary::InsideFirstPhase | Boundary::AfterFinish => 1,
        _ => 2,
    };
    for by_completer in [false, true] {
        let db = ride_db::<D>();
        kill_child_at_its_boundary(&db, test);
        let mut conn = db.conn();
        assert_eq!(
            recovery_points::<D>(&mut conn, KEY),
            left_behind(boundary),
            "what the child committed before {boundary:?}"
        );
        let rides = Rides::new(&db, killable());
        let reply = if by_completer {
            let completer = rides.completer().grace(Duration::milliseconds(1));
            match boundary {
                Boundary::InsideFirstPhase | Boundary::AfterFinish => {
                    let report = completer.run_once(&mut conn).expect("a completer pass");
                    assert_eq!(report, Completions::default(), "nothing to finish");
                }
                _ => complete_once::<D>(&completer, &mut conn),
            }
            match rides.create(&mut conn, KEY, &ada()) {
                Ok(Outcome::Replayed(reply)) if boundary != Boundary::InsideFirstPhase => reply,
                Ok(Outcome::Executed(reply)) if boundary == Boundary::InsideFirstPhase => reply,
                other => panic!("unexpected answer to the client: {other:?}"),
            }
        } else {
            match rides.create(&mut conn, KEY, &ada()) {
                Ok(Outcome::Replayed(reply)) if boundary == Boundary::AfterFinish => reply,
                Ok(Outcome::Executed(reply)) if boundary != Boundary::AfterFinish => reply,
                other => panic!("unexpected answer to the client: {other:?}"),
            }
        };
        let again = rides.create(&mut conn, KEY, &ada()).expect("another retry");
        assert_eq!(again, Outcome::Replayed(reply.clone()), "the same reply every time");
        assert_charged_once::<D>(&mut conn, &reply, requests);
        assert_eq!(rides.provider.requests(), requests_here, "requests after the kill");
        assert_eq!(
            attempts::<D>(&mut conn, KEY),
            attempts_made,
            "the killed attempt's and the resumer's"
        );
    }
}
