//! What a race of callers with one key must come to.

use idempotency::Outcome;

/// Asserts that of the racers' `outcomes` exactly one executed and every
/// racer got the value it executed; returns that value.
pub fn assert_one_executed_and_all_saw_it(outcomes: Vec<Outcome<i64>>) -> i64 {
    assert_eq!(
        outcomes.iter().filter(|outcome| !outcome.is_replayed()).count(),
        1,
        "one execution"
    );
    let values: Vec<i64> = outcomes.into_iter().map(Outcome::into_inner).collect();
    assert!(
        values.windows(2).all(|w| w[0] == w[1]),
        "every caller got the same value: {values:?}"
    );
    values[0]
}
