//! A fixed-capacity ring of timestamped values with a trailing-window max.

use std::collections::VecDeque;

/// Timestamped values, oldest first, never more than `capacity`.
///
/// It backs the `_max` gauges: the maximum over a trailing window, so a 15 s
/// scrape does not miss a 40 ms peak, and is not reset by scrapes (an HA pair
/// of Prometheus servers scrapes every agent twice).
#[derive(Debug, Clone)]
pub struct TimedRing<T> {
    items: VecDeque<(u64, T)>,
    capacity: usize,
}

impl<T: Copy + Ord> TimedRing<T> {
    /// An empty ring holding at most `capacity` values (at least 1), so memory
    /// stays bounded whatever the sample rate.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            items: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Appends a value at time `at_ns`, dropping the oldest when full.
    pub fn push(&mut self, at_ns: u64, value: T) {
        if self.items.len() == self.capacity {
            self.items.pop_front();
        }
        self.items.push_back((at_ns, value));
    }

    /// Largest value with a timestamp at or after `since_ns`.
    pub fn max_since(&self, since_ns: u64) -> Option<T> {
        self.items
            .iter()
            .rev()
            .take_while(|(t, _)| *t >= since_ns)
            .map(|(_, v)| *v)
            .max()
    }

    /// Values held now.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether nothing has been pushed yet.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_covers_only_the_window_and_capacity_bounds_memory() {
        let mut ring = TimedRing::new(3);
        ring.push(10, 5u64);
        ring.push(20, 9);
        ring.push(30, 1);
        assert_eq!(ring.max_since(0), Some(9));
        assert_eq!(ring.max_since(25), Some(1));
        assert_eq!(ring.max_since(31), None);
        ring.push(40, 2);
        assert_eq!(ring.len(), 3);
        // The 5 at t=10 fell out; 9 is still the max.
        assert_eq!(ring.max_since(0), Some(9));
    }
}
