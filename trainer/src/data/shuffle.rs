//! The order in which torchtitan re-reads a map-style dataset in epoch `e > 0`: Hugging Face
//! `Dataset.shuffle(seed=42 + e)`, which is NumPy's `default_rng(seed).permutation(len)`.
//!
//! That is NumPy's `SeedSequence` (entropy mixing into 4 pool words, then 8 state words),
//! `PCG64` (128-bit LCG with the XSL-RR output), and `Generator.shuffle`'s Fisher-Yates with
//! bounded integers drawn by masked rejection (`random_interval`, 32-bit draws taken from the two
//! halves of a 64-bit output while the bound fits 32 bits). The tests pin NumPy 2.4's outputs.

/// NumPy `default_rng(seed).permutation(n)`.
pub fn permutation(seed: u64, n: u64) -> Vec<u64> {
    let mut rng = Pcg64::from_seed(seed);
    let mut out: Vec<u64> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.interval(i);
        out.swap(i as usize, j as usize);
    }
    out
}

/// NumPy's `SeedSequence(seed).generate_state(8, uint32)` for a non-negative integer seed.
fn seed_sequence_state(seed: u64) -> [u32; 8] {
    const INIT_A: u32 = 0x43b0_d7e5;
    const MULT_A: u32 = 0x931e_8875;
    const INIT_B: u32 = 0x8b51_f9dd;
    const MULT_B: u32 = 0x58f3_8ded;
    const MIX_MULT_L: u32 = 0xca01_f9dd;
    const MIX_MULT_R: u32 = 0x4973_f715;
    const XSHIFT: u32 = 16;
    // The integer as little-endian 32-bit words (at least one).
    let entropy: Vec<u32> = if seed >> 32 == 0 {
        vec![seed as u32]
    } else {
        vec![seed as u32, (seed >> 32) as u32]
    };
    let mut hash_const = INIT_A;
    let mut hashmix = |value: u32| -> u32 {
        let mut v = value ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_A);
        v = v.wrapping_mul(hash_const);
        v ^ (v >> XSHIFT)
    };
    let mix = |x: u32, y: u32| -> u32 {
        let r = MIX_MULT_L
            .wrapping_mul(x)
            .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
        r ^ (r >> XSHIFT)
    };
    let mut pool = [0u32; 4];
    for (i, word) in pool.iter_mut().enumerate() {
        *word = hashmix(entropy.get(i).copied().unwrap_or(0));
    }
    for src in 0..4 {
        for dst in 0..4 {
            if src != dst {
                let h = hashmix(pool[src]);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }
    let mut hash_const = INIT_B;
    let mut state = [0u32; 8];
    for (i, word) in state.iter_mut().enumerate() {
        let mut v = pool[i % 4] ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_B);
        v = v.wrapping_mul(hash_const);
        *word = v ^ (v >> XSHIFT);
    }
    state
}

/// NumPy's `PCG64` bit generator (XSL-RR 128/64) with its buffered 32-bit draws.
struct Pcg64 {
    state: u128,
    inc: u128,
    /// The upper half of the last 64-bit output, not yet used by a 32-bit draw.
    spare: Option<u32>,
}

const PCG_MULTIPLIER: u128 = (2_549_297_995_355_413_924u128 << 64) | 4_865_540_595_714_422_341u128;

impl Pcg64 {
    fn from_seed(seed: u64) -> Self {
        let w = seed_sequence_state(seed);
        let word = |i: usize| u64::from(w[2 * i]) | (u64::from(w[2 * i + 1]) << 32);
        let initstate = (u128::from(word(0)) << 64) | u128::from(word(1));
        let initseq = (u128::from(word(2)) << 64) | u128::from(word(3));
        let mut rng = Pcg64 {
            state: 0,
            inc: (initseq << 1) | 1,
            spare: None,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(initstate);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self
            .state
            .wrapping_mul(PCG_MULTIPLIER)
            .wrapping_add(self.inc);
    }

    fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        let rot = (s >> 122) as u32;
        (((s >> 64) as u64) ^ (s as u64)).rotate_right(rot)
    }

    fn next_u32(&mut self) -> u32 {
        if let Some(v) = self.spare.take() {
            return v;
        }
        let v = self.next_u64();
        self.spare = Some((v >> 32) as u32);
        v as u32
    }

    /// A uniform integer in `[0, max]` (NumPy's `random_interval`).
    fn interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16, 32] {
            mask |= mask >> shift;
        }
        if max <= u64::from(u32::MAX) {
            loop {
                let v = u64::from(self.next_u32()) & mask;
                if v <= max {
                    return v;
                }
            }
        }
        loop {
            let v = self.next_u64() & mask;
            if v <= max {
                return v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeding_matches_numpy() {
        // np.random.SeedSequence(43).generate_state(8) and default_rng(43).bit_generator.state.
        assert_eq!(
            seed_sequence_state(43),
            [
                3994432209, 2044548950, 822718314, 4035392203, 869670481, 2305669894, 1979494431,
                1725801697
            ]
        );
        let rng = Pcg64::from_seed(43);
        assert_eq!(rng.state, 82603460112531164776355945615041298124);
        assert_eq!(rng.inc, 25065611243303971628957076795638243391);
    }

    #[test]
    fn permutations_match_numpy() {
        // np.random.default_rng(seed).permutation(n), NumPy 2.4.6.
        assert_eq!(permutation(43, 10), [2, 8, 9, 5, 7, 1, 4, 6, 0, 3]);
        assert_eq!(
            permutation(44, 17),
            [4, 11, 0, 16, 9, 8, 12, 10, 3, 15, 2, 13, 5, 1, 14, 6, 7]
        );
        let p = permutation(43, 100_000);
        assert_eq!(p[..5], [22957, 78721, 32416, 10744, 95846]);
        let weighted: u64 = p.iter().enumerate().map(|(i, &v)| i as u64 * v).sum();
        assert_eq!(weighted, 249971702014705);
        assert_eq!(permutation(45, 5000)[..4], [4656, 542, 1478, 1346]);
    }
}
