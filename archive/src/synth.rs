//! Deterministic synthetic tensors for tests and the benchmark: incompressible bytes and
//! checkpoint-like data (bf16 weights ~ N(0, 0.02) rounded to nearest even, fp32 master weights and
//! Adam moments), from a seed. Not used by the engine; it lives here so that the archive's unit
//! tests, its conformance suite and `bench/` all compress the same bytes.
//!
//! The bytes are part of what depends on this module: test expectations (compression ratios, frame
//! counts) and benchmark results compared across commits. Changing what a seed produces is a change
//! to all of them.

/// xorshift64*: tiny, fast and deterministic; not for anything that needs real randomness.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from any seed (the state is made odd, since xorshift must never be zero).
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A standard normal variate (Box-Muller, from two draws).
    pub fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// What a synthetic tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Incompressible bytes (datasets: already-compressed shards, images).
    Random,
    /// bf16 model weights ~ N(0, 0.02).
    Bf16Weights,
    /// fp32 master weights ~ N(0, 0.02).
    Fp32Weights,
    /// fp32 Adam first moment ~ N(0, 1e-3).
    Fp32ExpAvg,
    /// fp32 Adam second moment: squares of N(0, 1e-3).
    Fp32ExpAvgSq,
}

impl Kind {
    /// Bytes per element.
    pub fn width(self) -> usize {
        match self {
            Kind::Random => 1,
            Kind::Bf16Weights => 2,
            Kind::Fp32Weights | Kind::Fp32ExpAvg | Kind::Fp32ExpAvgSq => 4,
        }
    }
}

/// `x` as bf16 bits, rounded to nearest with ties to even, as frameworks convert (for finite `x`).
pub fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// Fills `out` with little-endian values of `kind` drawn from `rng`. `Random` fills every byte; for
/// the others a tail shorter than one element is left as it was.
pub fn fill(kind: Kind, rng: &mut Rng, out: &mut [u8]) {
    match kind {
        Kind::Random => {
            for c in out.chunks_mut(8) {
                let v = rng.next_u64().to_le_bytes();
                c.copy_from_slice(&v[..c.len()]);
            }
        }
        Kind::Bf16Weights => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&to_bf16(rng.normal() * 0.02).to_le_bytes());
            }
        }
        Kind::Fp32Weights | Kind::Fp32ExpAvg | Kind::Fp32ExpAvgSq => {
            for c in out.chunks_exact_mut(4) {
                let v = match kind {
                    Kind::Fp32Weights => rng.normal() * 0.02,
                    Kind::Fp32ExpAvg => rng.normal() * 1e-3,
                    _ => {
                        let g = rng.normal() * 1e-3;
                        g * g
                    }
                };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// `n` elements of `kind` from a generator seeded with `seed`.
pub fn tensor(kind: Kind, n: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0; n * kind.width()];
    fill(kind, &mut Rng::new(seed), &mut out);
    out
}

/// `n` bf16 values ~ N(0, 0.02), as model weights are.
pub fn bf16_weights(n: usize, seed: u64) -> Vec<u8> {
    tensor(Kind::Bf16Weights, n, seed)
}

/// `n` fp32 values ~ N(0, 1e-3), as optimizer state is.
pub fn fp32_values(n: usize, seed: u64) -> Vec<u8> {
    tensor(Kind::Fp32ExpAvg, n, seed)
}
