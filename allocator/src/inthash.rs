//! A hasher for the pool's own integer keys.

/// Hashes the pool's own integer keys: block lengths (multiples of 512)
/// for the stream caches, stream ids for the completion maps, the starts
/// of pending free ranges. SipHash (std's default) was a measurable share
/// of the alloc+free fast path and of observing completions, and these
/// keys come from the pool, not from an adversary. A multiply, then the high bits folded into the low ones that
/// pick the bucket.
#[derive(Default)]
pub(crate) struct IntHasher(u64);

impl std::hash::Hasher for IntHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let h = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type BuildIntHasher = std::hash::BuildHasherDefault<IntHasher>;
