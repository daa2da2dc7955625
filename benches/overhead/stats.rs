//! The arithmetic of the figures and the keys the scenarios send. Figures
//! are medians and nearest-rank percentiles rather than means, so that a
//! round disturbed by other work on the machine moves them least; they are
//! rounded to three decimals so that a report's JSON stays readable.

/// The median of `values`; the mean of the middle two for an even count.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// The nearest-rank percentile `p` (0..=100) of `values`.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

/// Fresh keys shaped like the random identifiers clients send (32 hex
/// digits), so inserts land all over the key index rather than at its end.
pub struct Keys(u64);

impl Keys {
    pub fn new(seed: u64) -> Keys {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Keys(seed ^ nanos | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn next_key(&mut self) -> String {
        format!("{:016x}{:016x}", self.next_u64(), self.next_u64())
    }
}
