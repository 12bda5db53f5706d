//! Per-stream limits: the marker-rate token bucket.

use super::*;

/// Token bucket holding up to one second of markers.
pub(super) struct TokenBucket {
    pub(super) rate: f64,
    pub(super) tokens: f64,
    pub(super) last: Instant,
}

impl TokenBucket {
    pub(super) fn new(rate: f64) -> Self {
        Self {
            rate,
            tokens: rate,
            last: Instant::now(),
        }
    }

    pub(super) fn take(&mut self, n: f64) -> bool {
        let now = Instant::now();
        self.tokens =
            (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(self.rate);
        self.last = now;
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}
