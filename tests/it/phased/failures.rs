//! Failures of the steps and of the provider.

use super::*;

crate::common::backend_tests!(
    failure_in_the_first_phase_leaves_the_key_free,
    phase_output_that_would_not_read_back_is_refused_and_rolls_back,
    panic_in_a_step_rolls_it_back_and_frees_the_lease,
    result_kept_from_another_operation_is_refused,
    provider_failing_before_charging_is_called_again_with_the_same_key,
    provider_timing_out_after_charging_gives_the_retry_the_same_charge,
);

fn failure_in_the_first_phase_leaves_the_key_free<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let failed = Phased::new(OPERATION).run(&mut conn, SCOPE, KEY, &ada(), |s| {
        s.phase("ride_created", |tx| {
            D::insert_ride(tx, "ride-1", &ada())?;
            Err::<String, _>(RideError::GaveUp)
        })?;
        unreachable!("the first phase failed")
    });
    let failed: Result<Outcome<Reply>, _> = failed;
    assert!(matches!(failed, Err(Error::Operation(RideError::GaveUp))), "{failed:?}");
    assert_eq!(recovery_points::<D>(&mut conn, KEY), None, "nothing committed");
    assert!(D::rides(&mut conn).is_empty(), "the phase's write rolled back");

    let other = NewRide {
        rider: String::from("grace"),
        cents: 25_00,
    };
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let reply = executed(rides.create(&mut conn, KEY, &other));
    assert_eq!(D::rides(&mut conn), [(reply.ride, Some(reply.charge))]);
}

/// A phase's output is what a resume returns in its place, so one that would
/// read back as another value (`Some(())` comes back as `None`) is refused
/// before its phase commits, as a result is.
fn phase_output_that_would_not_read_back_is_refused_and_rolls_back<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let refused: Result<Outcome<Reply>, _> = Phased::new(OPERATION).run(&mut conn, SCOPE, KEY, &ada(), |s| {
        let wrapped: Option<()> = s.phase("ride_created", |tx| {
            D::insert_ride(tx, "ride-1", &ada())?;
            Ok::<_, RideError>(Some(()))
        })?;
        unreachable!("the phase was refused, not {wrapped:?}")
    });
    assert!(matches!(refused, Err(Error::Codec(_))), "{refused:?}");
    assert_eq!(recovery_points::<D>(&mut conn, KEY), None, "nothing committed");
    assert!(D::rides(&mut conn).is_empty(), "the phase's write rolled back");

    let rides = Rides::new(&db, Phased::new(OPERATION));
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(D::rides(&mut conn), [(reply.ride, Some(reply.charge))]);
}

/// A panic in a phase or in `finish` rolls that step back, leaves the
/// connection out of its transaction and frees the lease: a retry on the
/// same connection resumes at once, not after the lease.
fn panic_in_a_step_rolls_it_back_and_frees_the_lease<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    // The lease is 90 s: a retry that resumes within this wait found it
    // freed. (The key is the test's own: PostgreSQL's advisory locks are
    // shared by every schema of the database, so other tests' keys would
    // hold this one's lock for a moment.)
    let phased = Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(5))));
    let attempt = |conn: &mut D::Conn, panic_in: &str| {
        phased.run(conn, SCOPE, "panic-in-a-step", &ada(), |s| {
            let ride: String = s.phase("ride_created", |tx| {
                D::insert_ride(tx, "ride-1", &ada())?;
                Ok::<_, RideError>(String::from("ride-1"))
            })?;
            s.phase("charge_noted", |tx| {
                D::set_ride_charge(tx, &ride, "charge-1")?;
                assert_ne!(panic_in, "phase", "a bug in the second phase");
                Ok::<_, RideError>(())
            })?;
            s.finish(|tx| {
                D::insert_ride(tx, "ride-2", &ada())?;
                assert_ne!(panic_in, "finish", "a bug in finish");
                Ok::<_, RideError>(ride)
            })
        })
    };

    // The second phase panics: the first stays, the second rolled back.
    // Then `finish` panics: the second phase is committed by now, `finish`
    // rolled back.
    for (panic_in, left) in [("phase", None), ("finish", Some(String::from("charge-1")))] {
        let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| attempt(&mut conn, panic_in)));
        assert!(crashed.is_err(), "the {panic_in} panicked");
        assert_eq!(
            D::rides(&mut conn),
            [(String::from("ride-1"), left)],
            "after the {panic_in} panicked"
        );
    }
    let finished = attempt(&mut conn, "nowhere").expect("the retry resumes at once");
    assert_eq!(finished, Outcome::Executed(String::from("ride-1")));
    assert_eq!(
        D::rides(&mut conn),
        [
            (String::from("ride-1"), Some(String::from("charge-1"))),
            (String::from("ride-2"), None)
        ]
    );
}

/// `Finished` is what an operation's own `finish` returns; one kept from
/// another operation would answer with a response this operation never
/// stored. `run` refuses it with a panic, after freeing the lease.
fn result_kept_from_another_operation_is_refused<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let phased = Phased::new(OPERATION).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(5))));
    let mut kept = None;
    let first: Result<Outcome<i64>, Error<RideError>> = phased.run(&mut conn, SCOPE, "kept-first", &1, |s| {
        kept = Some(s.finish(|_| Ok::<_, RideError>(42))?);
        Err(Error::Operation(RideError::GaveUp))
    });
    assert!(matches!(first, Err(Error::Operation(RideError::GaveUp))), "{first:?}");

    let smuggled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        phased.run(&mut conn, SCOPE, "kept-second", &1, |s| {
            s.phase("ride_created", |tx| {
                D::insert_ride(tx, "ride-2", &ada()).map_err(RideError::from)
            })?;
            Ok(kept.take().expect("kept from the first operation"))
        })
    }));
    assert!(smuggled.is_err(), "the second operation did not answer 42");

    let second = phased.run(&mut conn, SCOPE, "kept-second", &1, |s| {
        s.phase("ride_created", |tx| {
            D::insert_ride(tx, "ride-2", &ada()).map_err(RideError::from)
        })?;
        s.finish(|_| Ok::<_, RideError>(7))
    });
    assert_eq!(second.expect("resumes at once"), Outcome::Executed(7));
}

fn provider_failing_before_charging_is_called_again_with_the_same_key<D: RideDb>() {
    let (_db, mut conn, rides) = rides_on::<D>(Phased::new(OPERATION));
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(
        recovery_points::<D>(&mut conn, KEY).expect("the key is spent"),
        ["ride_created", "charged (started)"]
    );
    assert!(D::charges(&mut conn).is_empty());

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(rides.provider.requests(), 2);
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(attempts::<D>(&mut conn, KEY), 2);
}

fn provider_timing_out_after_charging_gives_the_retry_the_same_charge<D: RideDb>() {
    let (_db, mut conn, rides) = rides_on::<D>(Phased::new(OPERATION));
    rides.provider.then(Behaviour::TimeOutAfter);
    let timed_out = rides.create(&mut conn, KEY, &ada());
    assert!(
        matches!(
            timed_out,
            Err(Error::Operation(RideError::Provider(ProviderError::TimedOut)))
        ),
        "{timed_out:?}"
    );
    let charged = D::charges(&mut conn);
    assert_eq!(
        charged.len(),
        1,
        "the provider charged although the caller saw a timeout"
    );

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(
        reply.charge, charged[0].1,
        "the retry got the charge the timed-out call made"
    );
    assert_charged_once::<D>(&mut conn, &reply, 2);
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(reply)
    );
}
