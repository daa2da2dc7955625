//! Steps renamed or sharing a name, and requests or operations that do
//! not match what their key recorded.

use super::*;

crate::common::backend_tests!(
    calls_sharing_a_name_get_a_provider_key_each,
    renamed_step_is_refused_and_runs_nothing,
    another_request_under_the_same_key_is_a_mismatch,
    another_operation_under_a_spent_key_is_a_mismatch,
    another_operation_under_a_key_in_progress_is_a_mismatch_at_once,
);

/// A loop that charges two cards under one call name: each call gets its own
/// provider key (a provider deduplicating on one key would otherwise return
/// the first card's charge for the second), and a retry repeats the
/// unfinished second call under the key it had.
fn calls_sharing_a_name_get_a_provider_key_each<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let split = Phased::new("split_payment");
    let provider_keys = Mutex::new(Vec::<(String, String)>::new());
    let pay = |conn: &mut D::Conn, decline_second: bool| {
        split.run(conn, SCOPE, KEY, &ada(), |s| {
            s.phase("ride_created", |_| Ok::<_, RideError>(1_i64))?;
            let mut charges = Vec::new();
            for card in ["card-a", "card-b"] {
                let charge: String = s.call("charged", |provider_key| {
                    provider_keys
                        .lock()
                        .expect("not poisoned")
                        .push((card.to_owned(), provider_key.to_owned()));
                    if decline_second && card == "card-b" {
                        Err(RideError::Provider(ProviderError::Unavailable))
                    } else {
                        Ok(format!("{card}:{provider_key}"))
                    }
                })?;
                charges.push(charge);
            }
            s.finish(|_| Ok(charges))
        })
    };

    let failed = pay(&mut conn, true);
    assert!(matches!(failed, Err(Error::Operation(_))), "{failed:?}");
    let retried = pay(&mut conn, false).expect("the retry finishes");

    let provider_keys = provider_keys.into_inner().expect("not poisoned");
    let cards: Vec<&str> = provider_keys.iter().map(|(card, _)| card.as_str()).collect();
    assert_eq!(
        cards,
        ["card-a", "card-b", "card-b"],
        "the retry calls only the unfinished card"
    );
    assert_ne!(provider_keys[0].1, provider_keys[1].1, "a provider key per call");
    assert_eq!(
        provider_keys[1].1, provider_keys[2].1,
        "the repeated call keeps its key"
    );
    assert_eq!(
        retried.into_inner(),
        [
            format!("card-a:{}", provider_keys[0].1),
            format!("card-b:{}", provider_keys[1].1)
        ]
    );
}

/// `result` is the refusal of a step renamed at `position` from `recorded`
/// to `found`.
fn assert_renamed(result: Result<Outcome<Reply>, Error<RideError>>, (position, recorded, found): (usize, &str, &str)) {
    let Err(Error::PhaseRenamed {
        position: at,
        recorded: was,
        found: is,
    }) = result
    else {
        panic!("a renamed step is refused: {result:?}")
    };
    assert_eq!((at, was.as_str(), is.as_str()), (position, recorded, found));
}

fn renamed_step_is_refused_and_runs_nothing<D: RideDb>() {
    let (_db, mut conn, rides) = rides_on::<D>(Phased::new(OPERATION));
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));
    let ran = AtomicUsize::new(0);
    let step = || {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok::<_, RideError>(String::new())
    };

    // A deploy renamed the first phase.
    let renamed: Result<Outcome<Reply>, _> = rides.phased.run(&mut conn, SCOPE, KEY, &ada(), |s| {
        s.phase("ride_booked", |_| step())?;
        unreachable!("the renamed phase is refused")
    });
    assert_renamed(renamed, (0, "ride_created", "ride_booked"));

    // And the call.
    let renamed: Result<Outcome<Reply>, _> = rides.phased.run(&mut conn, SCOPE, KEY, &ada(), |s| {
        s.phase("ride_created", |_| step())?;
        s.call("card_charged", |_| step())?;
        unreachable!("the renamed call is refused")
    });
    assert_renamed(renamed, (1, "charged", "card_charged"));
    assert_eq!(ran.load(Ordering::SeqCst), 0, "no step ran");
    assert_eq!(
        recovery_points::<D>(&mut conn, KEY).expect("the operation"),
        ["ride_created", "charged (started)"],
        "nothing written"
    );

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_charged_once::<D>(&mut conn, &reply, 1);
}

fn another_request_under_the_same_key_is_a_mismatch<D: RideDb>() {
    let (_db, mut conn, rides) = rides_on::<D>(Phased::new(OPERATION));
    let dearer = NewRide { cents: 25_00, ..ada() };
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));
    let running = rides.create(&mut conn, KEY, &dearer);
    assert!(matches!(running, Err(Error::Mismatch)), "{running:?}");

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    let finished = rides.create(&mut conn, KEY, &dearer);
    assert!(matches!(finished, Err(Error::Mismatch)), "{finished:?}");
    assert_eq!(rides.provider.requests(), 2, "a mismatch calls nobody");
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(reply)
    );
}

/// The operation that gives a ride's charge back: another name under the
/// ride's key, with the ride's request.
const REFUND: &str = "refund-ride";

fn refund<D: RideDb>(conn: &mut D::Conn, phased: &Phased, ran: &AtomicUsize) -> Result<Outcome<u32>, Error<RideError>> {
    phased.run(conn, SCOPE, KEY, &ada(), |s| {
        s.finish(|_| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, RideError>(7)
        })
    })
}

fn another_operation_under_a_spent_key_is_a_mismatch<D: RideDb>() {
    let (_db, mut conn, rides) = rides_on::<D>(Phased::new(OPERATION));
    let ran = AtomicUsize::new(0);
    rides.provider.then(Behaviour::FailBefore);
    assert!(matches!(
        rides.create(&mut conn, KEY, &ada()),
        Err(Error::Operation(RideError::Provider(ProviderError::Unavailable)))
    ));
    // Running with its lease freed: the refund may not take it over.
    let running = refund::<D>(&mut conn, &Phased::new(REFUND), &ran);
    assert!(matches!(running, Err(Error::Mismatch)), "{running:?}");
    // The same phases under another name: not a resume of the ride either.
    let renamed = rides.with(Phased::new(REFUND)).create(&mut conn, KEY, &ada());
    assert!(matches!(renamed, Err(Error::Mismatch)), "{renamed:?}");

    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    // Finished: neither the ride's reply nor a `Codec` failure for the
    // whole retention because a `u32` cannot read it.
    let finished = refund::<D>(&mut conn, &Phased::new(REFUND), &ran);
    assert!(matches!(finished, Err(Error::Mismatch)), "{finished:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the refund never ran");
    assert_eq!(rides.provider.requests(), 2, "a mismatch calls nobody");
    assert_charged_once::<D>(&mut conn, &reply, 1);
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(reply)
    );
}

fn another_operation_under_a_key_in_progress_is_a_mismatch_at_once<D: RideDb>() {
    let db = ride_db::<D>();
    let rides = Rides::new(&db, Phased::new(OPERATION));
    let (gate, arrived, open) = gate();
    rides.provider.then(Behaviour::Block(gate));
    let pool = db.pool(2);
    let ran = AtomicUsize::new(0);
    // Waiting for a lease that the ride holds until the test opens the gate:
    // anything but an answer at once would be `InProgress` after the wait.
    let patient = Phased::new(REFUND).config(Config::default().in_flight(InFlight::Wait(Duration::seconds(10))));
    std::thread::scope(|s| {
        let first = s.spawn(|| rides.create(&mut pool.get().expect("a connection"), KEY, &ada()));
        wait::recv(&arrived, "the ride reaches the provider");
        let refunded = refund::<D>(&mut pool.get().expect("a connection"), &patient, &ran);
        assert!(matches!(refunded, Err(Error::Mismatch)), "{refunded:?}");
        open.send(()).expect("release the provider");
        let reply = executed(first.join().expect("the ride"));
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the refund never ran");
        assert_charged_once::<D>(&mut pool.get().expect("a connection"), &reply, 1);
    });
}
