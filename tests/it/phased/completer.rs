//! The completer: finishing abandoned operations, beside client retries.

use super::*;

crate::common::backend_tests!(
    completer_finishes_an_abandoned_operation,
    completer_leaves_operations_without_a_stored_request_to_their_clients,
    completer_racing_client_retries_finishes_each_operation_once,
    completer_skips_operations_in_their_grace_period_or_under_lease,
    completer_parks_after_max_attempts_and_requeue_brings_it_back,
    completer_retries_a_failed_operation_once_its_grace_ran_out,
);

fn completer_finishes_an_abandoned_operation<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(identity);
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));

    let completer = rides.completer().clock(clock.source());
    assert_eq!(completer.run_once(&mut conn).expect("a pass"), Completions::default());
    clock.advance(Duration::minutes(5));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (1, 1, 0, 0, 0));
    assert_eq!(
        recovery_points::<D>(&mut conn, KEY).expect("the operation"),
        ["completed"]
    );

    let replay = rides.create(&mut conn, KEY, &ada()).expect("the client's retry");
    let Outcome::Replayed(reply) = replay else {
        panic!("the completer finished it: {replay:?}")
    };
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(completer.run_once(&mut conn).expect("a pass"), Completions::default());
}

fn completer_leaves_operations_without_a_stored_request_to_their_clients<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(|ride| ride.store_requests(false));
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));

    clock.advance(Duration::minutes(10));
    let completer = rides.completer().clock(clock.source());
    assert_eq!(completer.run_once(&mut conn).expect("a pass"), Completions::default());
    assert!(completer.parked(&mut conn, 10).expect("parked ones").is_empty());

    let resumed = rides.create(&mut conn, KEY, &ada()).expect("the client's retry");
    assert!(!resumed.is_replayed(), "the client's retry finishes it");
    assert_charged_once::<D>(&mut conn, &resumed.into_inner(), 1);
}

fn completer_racing_client_retries_finishes_each_operation_once<D: RideDb>() {
    const OPERATIONS: usize = 6;
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let phased = create_ride(&clock).config(config(&clock).in_flight(InFlight::Wait(Duration::seconds(30))));
    let rides = Rides::new(&db, phased);
    let keys: Vec<String> = (0..OPERATIONS).map(|i| format!("ride-{i}")).collect();
    for key in &keys {
        rides.provider.then(Behaviour::FailBefore);
        assert_provider_unavailable(rides.create(&mut db.conn(), key, &ada()));
    }
    clock.advance(Duration::minutes(5));

    let completer = rides.completer().clock(clock.source());
    let pool = db.pool(OPERATIONS as u32 + 1);
    let barrier = Barrier::new(OPERATIONS + 1);
    let (report, replies) = std::thread::scope(|s| {
        let completing = s.spawn(|| {
            let mut conn = pool.get().expect("a connection");
            barrier.wait();
            completer.run_once(&mut conn)
        });
        let clients: Vec<_> = keys
            .iter()
            .map(|key| {
                let (pool, barrier, rides) = (&pool, &barrier, &rides);
                s.spawn(move || {
                    let mut conn = pool.get().expect("a connection");
                    barrier.wait();
                    rides.create(&mut conn, key, &ada())
                })
            })
            .collect();
        let replies: Vec<Reply> = clients
            .into_iter()
            .map(|client| client.join().expect("a client").expect("a reply").into_inner())
            .collect();
        (completing.join().expect("the completer").expect("a pass"), replies)
    });
    let (picked, completed, failed, skipped, parked) = counts(&report);
    assert!(picked <= OPERATIONS, "{report:?}");
    assert_eq!((completed + skipped, failed, parked), (picked, 0, 0), "{report:?}");

    let mut conn = db.conn();
    for (key, reply) in keys.iter().zip(&replies) {
        let again = rides.create(&mut conn, key, &ada()).expect("a replay");
        assert_eq!(again, Outcome::Replayed(reply.clone()), "the same reply for {key}");
    }
    let mut rides_made: Vec<_> = D::rides(&mut conn);
    let mut replied: Vec<_> = replies
        .iter()
        .map(|reply| (reply.ride.clone(), Some(reply.charge.clone())))
        .collect();
    rides_made.sort();
    replied.sort();
    assert_eq!(rides_made, replied, "one ride per operation, as replied");
    let charges = D::charges(&mut conn);
    assert_eq!(charges.len(), OPERATIONS);
    assert!(
        charges.iter().all(|charge| charge.3 == 1),
        "each charged at one request: {charges:?}"
    );
    assert_eq!(D::receipts(&mut conn).len(), OPERATIONS);
    assert_eq!(
        rides.provider.requests(),
        2 * OPERATIONS,
        "a failed and a charging request each"
    );
}

fn completer_skips_operations_in_their_grace_period_or_under_lease<D: RideDb>() {
    let db = ride_db::<D>();
    let clock = ManualClock::new();
    let rides = Rides::new(&db, create_ride(&clock).lease(Duration::minutes(10)));
    let completer = rides.completer().clock(clock.source());
    let mut conn = db.conn();
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, "abandoned", &ada()));
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    std::thread::scope(|s| {
        let held = s.spawn(|| rides.create(&mut db.conn(), "held", &ada()));
        wait::recv(&arrived, "the held attempt reaches the provider");

        clock.advance(Duration::minutes(4));
        assert_eq!(
            completer.run_once(&mut conn).expect("a pass"),
            Completions::default(),
            "both in their grace period"
        );
        clock.advance(Duration::minutes(2));
        let report = completer.run_once(&mut conn).expect("a pass");
        assert_eq!(counts(&report), (1, 1, 0, 0, 0), "only the abandoned one");
        assert_eq!(recovery_points::<D>(&mut conn, "abandoned").expect("it"), ["completed"]);
        assert_eq!(
            recovery_points::<D>(&mut conn, "held").expect("it"),
            ["ride_created", "charged (started)"],
            "the held one is left to its attempt"
        );
        open.send(()).expect("release the held attempt");
        executed(held.join().expect("the held attempt"));
    });
    assert_eq!(rides.provider.requests(), 3);
    assert_eq!(D::charges(&mut conn).len(), 2);
}

fn completer_parks_after_max_attempts_and_requeue_brings_it_back<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(identity);
    let completer = rides.completer().clock(clock.source()).max_attempts(2);
    fail_the_client_and_then_the_completer(&mut conn, &rides, &completer, &clock, Duration::minutes(5));
    clock.advance(Duration::minutes(5));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (0, 0, 0, 0, 1), "out of attempts");

    let parked = completer.parked(&mut conn, 10).expect("the parked operations");
    assert_eq!(parked.len(), 1);
    let (scope, key, operation) = (&parked[0].scope, &parked[0].key, &parked[0].operation);
    assert_eq!(
        (scope.as_str(), key.as_str(), operation.as_str()),
        (SCOPE, KEY, OPERATION)
    );
    assert_eq!(parked[0].attempts, 2);
    assert_eq!(parked[0].reason.as_deref(), Some("gave up after 2 attempts"));
    assert_eq!(parked[0].parked_at, clock.now());
    let parked_retry = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(parked_retry, Err(Error::Parked)), "{parked_retry:?}");
    assert_eq!(rides.provider.requests(), 2, "a parked operation calls nobody");

    assert!(completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"));
    assert!(
        !completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"),
        "no longer parked"
    );
    assert!(
        completer
            .parked(&mut conn, 10)
            .expect("the parked operations")
            .is_empty()
    );
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(attempts::<D>(&mut conn, KEY), 1, "attempts counted afresh");
}

fn completer_retries_a_failed_operation_once_its_grace_ran_out<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(identity);
    let completer = rides.completer().clock(clock.source()).grace(Duration::minutes(1));
    fail_the_client_and_then_the_completer(&mut conn, &rides, &completer, &clock, Duration::minutes(1));
    clock.advance(Duration::minutes(1));
    let report = completer.run_once(&mut conn).expect("a pass");
    assert_eq!(counts(&report), (1, 1, 0, 0, 0), "taken up again after the grace");
    assert_eq!(attempts::<D>(&mut conn, KEY), 3);
}

/// Fails the operation under `KEY` twice: the client's attempt, then, when
/// `grace` has passed, the completer's, which leaves it alone for another
/// grace period.
fn fail_the_client_and_then_the_completer<D: RideDb>(
    conn: &mut D::Conn,
    rides: &Rides<D>,
    completer: &Completer<D::Conn>,
    clock: &ManualClock,
    grace: Duration,
) {
    rides.provider.then(Behaviour::FailBefore).then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(conn, KEY, &ada()));
    clock.advance(grace);
    let report = completer.run_once(conn).expect("a pass");
    assert_eq!(counts(&report), (1, 0, 1, 0, 0), "the completer's attempt failed");
    assert_eq!(
        completer.run_once(conn).expect("a pass"),
        Completions::default(),
        "in grace"
    );
}
