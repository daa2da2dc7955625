//! What the property tests share: how many cases they run, and random
//! numbers that a failing run repeats.

/// How many cases a property runs: `IDEMPOTENCY_PROPERTY_CASES`, or
/// `default`, a count that runs in seconds.
pub fn cases(default: usize) -> usize {
    std::env::var("IDEMPOTENCY_PROPERTY_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}

/// splitmix64: deterministic, so a failing run can be repeated.
pub struct Prng(pub u64);

impl Prng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
