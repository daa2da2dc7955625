//! What the property tests share: how many cases they run, and random
//! numbers without a dependency.

/// How many cases a property runs: `IDEMPOTENCY_PROPERTY_CASES`, or
/// `default`, a count that runs in about a second.
pub(crate) fn cases(default: usize) -> usize {
    std::env::var("IDEMPOTENCY_PROPERTY_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}

/// Random words from `seed`: SplitMix64.
pub(crate) fn random_words(seed: u64) -> impl Iterator<Item = u64> {
    let mut state = seed;
    std::iter::repeat_with(move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// Random numbers below the bound it is called with, from `seed`.
pub(crate) fn random_below(seed: u64) -> impl FnMut(usize) -> usize {
    let mut words = random_words(seed);
    move |below| {
        let word = words.next().unwrap_or_default() % u64::try_from(below).unwrap_or(u64::MAX);
        usize::try_from(word).unwrap_or_default()
    }
}
