//! Retries racing each other, and attempts whose lease ran out fenced out.

use super::*;

crate::common::backend_tests!(
    concurrent_retries_during_a_blocked_call_charge_once,
    attempt_whose_lease_ran_out_mid_call_is_fenced_out,
    retry_taking_over_after_another_attempt_progressed_resumes_from_its_progress,
);

fn concurrent_retries_during_a_blocked_call_charge_once<D: RideDb>() {
    const RETRIES: usize = 32;
    let db = ride_db::<D>();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    let pool = db.pool(RETRIES as u32 + 1);
    let rejecting = rides.with(Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Reject)));
    let waiting =
        rides.with(Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(60)))));
    let barrier = Barrier::new(RETRIES);
    let retry = |rides: &Rides<D>| {
        let mut conn = pool.get().expect("a connection");
        barrier.wait();
        rides.create(&mut conn, KEY, &ada())
    };
    std::thread::scope(|s| {
        let first = s.spawn(|| rides.create(&mut pool.get().expect("a connection"), KEY, &ada()));
        wait::recv(&arrived, "the first attempt reaches the provider");
        let rejected: Vec<_> = (0..RETRIES / 2).map(|_| s.spawn(|| retry(&rejecting))).collect();
        let waited: Vec<_> = (0..RETRIES / 2).map(|_| s.spawn(|| retry(&waiting))).collect();
        for retry in rejected {
            let result = retry.join().expect("a rejected retry");
            assert!(matches!(result, Err(Error::InProgress)), "{result:?}");
        }
        open.send(()).expect("release the provider");
        let reply = executed(first.join().expect("the first attempt"));
        for retry in waited {
            let result = retry.join().expect("a waiting retry");
            assert_eq!(result.expect("a waiting retry"), Outcome::Replayed(reply.clone()));
        }
        assert_eq!(rides.provider.requests(), 1, "the provider was asked once");
        assert_charged_once::<D>(&mut pool.get().expect("a connection"), &reply, 1);
    });
}

fn attempt_whose_lease_ran_out_mid_call_is_fenced_out<D: RideDb>() {
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).lease(Duration::minutes(1)));
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    std::thread::scope(|s| {
        let late = s.spawn(|| rides.create(&mut db.conn(), KEY, &ada()));
        wait::recv(&arrived, "the first attempt reaches the provider");
        clock.advance(Duration::minutes(2));

        let mut conn = db.conn();
        let reply = executed(rides.create(&mut conn, KEY, &ada()));
        assert_eq!(attempts::<D>(&mut conn, KEY), 2, "the retry took the operation over");
        open.send(()).expect("release the late attempt's call");
        let late = late.join().expect("the late attempt");
        assert!(matches!(late, Err(Error::InProgress)), "{late:?}");

        assert_eq!(
            recovery_points::<D>(&mut conn, KEY).expect("the operation"),
            ["completed"]
        );
        assert_eq!(
            rides.create(&mut conn, KEY, &ada()).expect("a replay"),
            Outcome::Replayed(reply.clone()),
            "the late attempt changed nothing"
        );
        assert_charged_once::<D>(&mut conn, &reply, 2);
    });
}

fn retry_taking_over_after_another_attempt_progressed_resumes_from_its_progress<D: RideDb>() {
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let plain = Phased::new(OPERATION).config(config(&clock));
    // A clock that holds its first reading after it is armed: the reading
    // an attempt takes right after it read the operation, before it takes
    // it over.
    let armed = Arc::new(AtomicBool::new(false));
    let (read_tx, read) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let pausing = {
        let (clock, armed, go_rx) = (clock.clone(), Arc::clone(&armed), Mutex::new(go_rx));
        Phased::new(OPERATION).config(Config::default().clock(move || {
            if armed.swap(false, Ordering::SeqCst) {
                read_tx.send(()).expect("the test waits for the read");
                wait::recv(&go_rx.lock().expect("the gate"), "the test lets it go");
            }
            clock.now()
        }))
    };
    // Books the ride and queues its receipt in two phases; an attempt with
    // `give_up_after` returns an error after that many.
    let attempt = |phased: &Phased, give_up_after: Option<usize>| {
        phased.run(&mut db.conn(), SCOPE, KEY, &ada(), |s| {
            let ride = s.phase("ride_created", |tx| {
                let id = crate::common::unique_name("ride");
                D::insert_ride(tx, &id, &ada())?;
                Ok::<_, RideError>(id)
            })?;
            if give_up_after == Some(1) {
                return Err(Error::Operation(RideError::GaveUp));
            }
            s.phase("receipt_queued", |tx| {
                outbox::enqueue(tx, RECEIPTS, &ride)?;
                Ok::<_, RideError>(())
            })?;
            if give_up_after == Some(2) {
                return Err(Error::Operation(RideError::GaveUp));
            }
            s.finish(|_| Ok::<_, RideError>(ride))
        })
    };
    let gave_up = attempt(&plain, Some(1));
    assert!(
        matches!(gave_up, Err(Error::Operation(RideError::GaveUp))),
        "{gave_up:?}"
    );
    armed.store(true, Ordering::SeqCst);
    std::thread::scope(|s| {
        let late = s.spawn(|| attempt(&pausing, None));
        wait::recv(&read, "the late attempt read the operation");
        // Another attempt queues the receipt and gives up.
        let gave_up = attempt(&plain, Some(2));
        assert!(
            matches!(gave_up, Err(Error::Operation(RideError::GaveUp))),
            "{gave_up:?}"
        );
        go.send(()).expect("let the late attempt go on");
        let late = late.join().expect("the late attempt");
        assert!(matches!(late, Ok(Outcome::Executed(_))), "{late:?}");
    });
    let mut conn = db.conn();
    assert_eq!(D::rides(&mut conn).len(), 1);
    assert_eq!(D::receipts(&mut conn).len(), 1, "the committed phase ran once");
}

/// SQLite: taking an operation over takes the write lock, which another
/// writer may hold; under `InFlight::Reject` that is a 409, as for every
/// other write of an attempt.
#[test]
fn sqlite_takeover_kept_out_by_another_writer_is_in_progress() {
    let db = ride_db::<crate::common::sqlite::Db>();
    let mut conn = db.conn();
    let rejecting = Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Reject));
    let rides = Rides::new(&db, rejecting);
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));

    let mut writer = db.conn();
    writer.batch_execute("BEGIN IMMEDIATE").expect("hold the write lock");
    let kept_out = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(kept_out, Err(Error::InProgress)), "{kept_out:?}");
    writer.batch_execute("ROLLBACK").expect("let the write lock go");
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_charged_once::<crate::common::sqlite::Db>(&mut conn, &reply, 1);
}

/// PostgreSQL: an attempt whose lease ran out while its last transaction was
/// open finds the operation taken over when it commits, and its writes roll
/// back. On SQLite an open transaction holds the write lock, so no attempt
/// can take the operation over meanwhile.
#[cfg(feature = "postgres")]
#[test]
fn postgres_finish_fenced_after_its_lease_ran_out_rolls_back_its_writes() {
    use crate::common::ServerDb;
    use crate::common::pg::Db;

    let db = ride_db::<Db>();
    let clock = ManualClock::new();
    let phased = Phased::new(OPERATION)
        .lease(Duration::minutes(1))
        .config(config(&clock).in_flight(InFlight::Wait(Duration::seconds(30))));
    let rides = Rides::new(&db, phased);
    let (inside_tx, inside) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let hold_inside_finish = |reached: Boundary| {
        if reached == Boundary::InsideFinish {
            inside_tx.send(()).expect("the test waits");
            wait::recv(&go_rx.lock().expect("the gate"), "the test lets it go");
        }
    };
    let mut admin = db.conn();
    let mut retry_conn = db.conn();
    let retry_session = Db::session_id(&mut retry_conn);
    let reply = std::thread::scope(|s| {
        let late = s.spawn(|| rides.create_stopping(&mut db.conn(), KEY, &ada(), &hold_inside_finish));
        wait::recv(&inside, "the late attempt wrote the charge and the receipt");
        clock.advance(Duration::minutes(2));
        let retry = s.spawn(|| rides.create(&mut retry_conn, KEY, &ada()));
        // The retry took the operation over and waits for the key, which
        // the late attempt's open transaction holds.
        Db::wait_until_waiting_for_a_key(&mut admin, retry_session);
        go.send(()).expect("let the late attempt commit");
        let late = late.join().expect("the late attempt");
        assert!(matches!(late, Err(Error::InProgress)), "{late:?}");
        executed(retry.join().expect("the retry"))
    });
    assert_charged_once::<Db>(&mut admin, &reply, 1);
    assert_eq!(attempts::<Db>(&mut admin, KEY), 2);
}
