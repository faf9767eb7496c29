//! The placement hash: SipHash-1-3 keyed by the table's salt, so a client that does not know
//! the salt cannot choose ids that land in the same groups (SipHash is a keyed PRF; the
//! digest it replaces, SHA-256 of salt and id, cost ten times more per lookup for the same
//! guarantee). The same function `std`'s `HashMap` uses, written out because `std` offers it
//! only with random keys, and every worker of an instance must place a key in the same groups.

/// A SipHash key: two 64-bit words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key(pub u64, pub u64);

impl Key {
    /// The key derived from a salt of any length (every worker of an instance reads the same
    /// salt, so derives the same key).
    pub fn from_salt(salt: &[u8]) -> Self {
        Key(
            sip13(Key(0x7461_626c_652d_6b30, 0x746f_6c6c_6761_7465), salt),
            sip13(Key(0x7461_626c_652d_6b31, 0x746f_6c6c_6761_7465), salt),
        )
    }
}

/// SipHash-1-3 of `data` under `key`.
pub fn sip13(key: Key, data: &[u8]) -> u64 {
    sip::<1, 3>(key, data)
}

/// The `i`-th of a key's candidate words from its hash: a bijective mix (SplitMix64's
/// finalizer) of the hash and the index, so the words of one id look independent and are as
/// unknown to a client as the hash itself.
pub fn candidate_word(hash: u64, i: u32) -> u64 {
    if i == 0 {
        return hash;
    }
    let mut z = hash.wrapping_add(u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct State {
    v0: u64,
    v1: u64,
    v2: u64,
    v3: u64,
}

impl State {
    #[inline(always)]
    fn round(&mut self) {
        self.v0 = self.v0.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(13) ^ self.v0;
        self.v0 = self.v0.rotate_left(32);
        self.v2 = self.v2.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(16) ^ self.v2;
        self.v0 = self.v0.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(21) ^ self.v0;
        self.v2 = self.v2.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(17) ^ self.v2;
        self.v2 = self.v2.rotate_left(32);
    }

    #[inline(always)]
    fn compress<const C: usize>(&mut self, m: u64) {
        self.v3 ^= m;
        for _ in 0..C {
            self.round();
        }
        self.v0 ^= m;
    }
}

/// SipHash-C-D (the reference algorithm; `C` compression and `D` finalization rounds).
fn sip<const C: usize, const D: usize>(key: Key, data: &[u8]) -> u64 {
    let mut s = State {
        v0: key.0 ^ 0x736f_6d65_7073_6575,
        v1: key.1 ^ 0x646f_7261_6e64_6f6d,
        v2: key.0 ^ 0x6c79_6765_6e65_7261,
        v3: key.1 ^ 0x7465_6462_7974_6573,
    };
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        s.compress::<C>(u64::from_le_bytes(word));
    }
    // The last block: the remaining bytes and the length's low byte on top.
    let mut last = (data.len() as u64) << 56;
    for (i, byte) in chunks.remainder().iter().enumerate() {
        last |= u64::from(*byte) << (8 * i);
    }
    s.compress::<C>(last);
    s.v2 ^= 0xff;
    for _ in 0..D {
        s.round();
    }
    s.v0 ^ s.v1 ^ s.v2 ^ s.v3
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    /// SipHash-2-4 under arbitrary keys against `std`'s (specified as SipHash-2-4), so the
    /// rounds, the key schedule and the last block are the reference's.
    #[test]
    #[allow(deprecated)]
    fn matches_the_reference_siphash_2_4() {
        let data: Vec<u8> = (0u8..=70).collect();
        for len in 0..data.len() {
            for key in [Key(0, 0), Key(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908)] {
                let mut reference = std::hash::SipHasher::new_with_keys(key.0, key.1);
                reference.write(&data[..len]);
                assert_eq!(sip::<2, 4>(key, &data[..len]), reference.finish(), "{len}");
            }
        }
    }

    /// The reference paper's SipHash-2-4 vector: key 00..0f, message 00..0e.
    #[test]
    fn paper_vector() {
        let data: Vec<u8> = (0u8..15).collect();
        assert_eq!(
            sip::<2, 4>(Key(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908), &data),
            0xa129_ca61_49be_45e5
        );
    }

    #[test]
    fn keys_and_indices_change_the_words() {
        let a = Key::from_salt(b"salt-a");
        let b = Key::from_salt(b"salt-b");
        assert_ne!(a, b);
        assert_ne!(sip13(a, b"p:k"), sip13(b, b"p:k"));
        assert_ne!(sip13(a, b"p:k"), sip13(a, b"p:l"));
        let h = sip13(a, b"p:k");
        let words: Vec<u64> = (0..4).map(|i| candidate_word(h, i)).collect();
        for (i, w) in words.iter().enumerate() {
            assert!(!words[..i].contains(w));
        }
    }
}
