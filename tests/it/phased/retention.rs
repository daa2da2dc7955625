//! Keys past their retention, and the purge of finished operations.

use super::*;

crate::common::backend_tests!(
    key_executing_again_after_retention_charges_under_a_new_provider_key,
    purge_deletes_finished_operations_only,
);

fn key_executing_again_after_retention_charges_under_a_new_provider_key<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(identity);
    let first = executed(rides.create(&mut conn, KEY, &ada()));
    clock.advance(Duration::hours(23));
    assert_eq!(
        rides.create(&mut conn, KEY, &ada()).expect("a replay"),
        Outcome::Replayed(first.clone())
    );

    clock.advance(Duration::hours(1));
    let second = executed(rides.create(&mut conn, KEY, &ada()));
    assert_ne!(second.ride, first.ride, "a new ride");
    assert_ne!(second.charge, first.charge, "charged anew, not handed the old charge");
    let charges = D::charges(&mut conn);
    assert_eq!(charges.len(), 2);
    assert_ne!(charges[0].0, charges[1].0, "under another provider key");
    assert_eq!(D::rides(&mut conn).len(), 2);
}

fn purge_deletes_finished_operations_only<D: RideDb>() {
    let (_db, mut conn, clock, rides) = clocked_rides::<D>(|ride| ride.provider_horizon(Duration::hours(1)));
    executed(rides.create(&mut conn, "finished", &ada()));
    rides.provider.then(Behaviour::FailBefore).then(Behaviour::FailBefore);
    assert_provider_unavailable(rides.create(&mut conn, "running", &ada()));
    assert_provider_unavailable(rides.create(&mut conn, "parked", &ada()));
    clock.advance(Duration::hours(2));
    assert!(matches!(rides.create(&mut conn, "parked", &ada()), Err(Error::Parked)));
    clock.advance(Duration::days(30));

    assert_eq!(config(&clock).purge_expired(&mut conn, 1).expect("purge"), 1);
    assert_eq!(recovery_points::<D>(&mut conn, "finished"), None);
    assert_eq!(
        recovery_points::<D>(&mut conn, "running").expect("kept"),
        ["ride_created", "charged (started)"]
    );
    assert_eq!(recovery_points::<D>(&mut conn, "parked").expect("kept"), ["parked"]);
}
