//! Operations parked for a person, and requeued.

use super::*;

crate::common::backend_tests!(
    provider_horizon_parks_the_operation_for_a_person,
    requeued_operation_past_its_horizon_makes_the_call_again,
    interrupted_at_most_once_call_parks_until_requeued,
);

fn provider_horizon_parks_the_operation_for_a_person<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(|ride| ride.provider_horizon(Duration::hours(1)));
    rides.provider.then(Behaviour::FailBefore).then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));
    clock.advance(Duration::minutes(59));
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(rides.provider.requests(), 2);

    clock.advance(Duration::minutes(1));
    let parked = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(parked, Err(Error::Parked)), "{parked:?}");
    assert_eq!(rides.provider.requests(), 2, "never made past the horizon");
    let parked_again = rides.create(&mut conn, KEY, &ada());
    assert!(matches!(parked_again, Err(Error::Parked)), "{parked_again:?}");
    assert_eq!(rides.provider.requests(), 2);

    let completer = rides.completer().clock(clock.source());
    let listed = completer.parked(&mut conn, 10).expect("the parked operations");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, KEY);
    assert_eq!(listed[0].attempts, 3);
    assert_eq!(
        listed[0].reason.as_deref(),
        Some("call charged is past its provider horizon")
    );
    clock.advance(Duration::hours(1));
    assert_eq!(
        completer.run_once(&mut conn).expect("a pass"),
        Completions::default(),
        "completers leave parked operations alone"
    );
    assert!(D::charges(&mut conn).is_empty());
}

fn requeued_operation_past_its_horizon_makes_the_call_again<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(|ride| ride.provider_horizon(Duration::hours(1)));
    rides.provider.then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, KEY, &ada()));
    clock.advance(Duration::hours(2));
    assert!(matches!(rides.create(&mut conn, KEY, &ada()), Err(Error::Parked)));

    // Someone checked with the provider that nothing was charged.
    let completer = rides.completer().clock(clock.source());
    assert!(completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"));
    let reply = executed(rides.create(&mut conn, KEY, &ada()));
    assert_eq!(rides.provider.requests(), 2, "the call was made again");
    assert_charged_once::<D>(&mut conn, &reply, 1);
}

fn interrupted_at_most_once_call_parks_until_requeued<D: RideDb>() {
    let db = ride_db::<D>();
    let mut conn = db.conn();
    let clock = ManualClock::new();
    let provider = Provider::<D>::new(db.url());
    let phased = create_ride(&clock);
    // A provider that does not deduplicate: its call is made at most once.
    let pay = |conn: &mut D::Conn| {
        phased.run(conn, SCOPE, KEY, &ada(), |s| {
            let charge = s.call_at_most_once("charged", |provider_key| {
                provider.charge(provider_key, ada().cents).map_err(RideError::Provider)
            })?;
            s.finish(|_| Ok::<_, RideError>(charge))
        })
    };
    provider.then(Behaviour::FailBefore);
    assert!(pay(&mut conn).is_err(), "the call failed: it may have been applied");
    let parked = pay(&mut conn);
    assert!(matches!(parked, Err(Error::Parked)), "{parked:?}");
    assert_eq!(provider.requests(), 1, "never made twice by itself");

    let completer = Completer::<D::Conn>::new().clock(clock.source());
    let listed = completer.parked(&mut conn, 10).expect("the parked operations");
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].reason.as_deref(),
        Some("call charged was interrupted and is never repeated")
    );
    // Someone checked with the provider that nothing was charged.
    assert!(completer.requeue(&mut conn, SCOPE, KEY).expect("requeue"));
    let charge = pay(&mut conn).expect("the call made again").into_inner();
    assert_eq!(provider.requests(), 2);
    assert_eq!(D::charges(&mut conn)[0].1, charge);
}
