//! A unit read from the origin as several pieces at once, and its hash.
//!
//! Why: the job's other nodes can take a unit only once its owner holds all of it (its hash goes
//! out before its bytes). Read as one request per unit, a node's units all progress together, one
//! per budget slot (16 by default), and complete together: with an origin that is the limit for
//! the whole job, the nodes then take most of each other's units in a burst near the end, after
//! the origin is done, and the job takes that much longer than one node would. Read as pieces of
//! `unit_size / [stage] concurrency` through the same slots, a node works on about one unit at a
//! time and finishes its units one after another, so its peers take each while the origin is
//! still busy with the next: what is left when the origin is done is about one unit per node.
//! Pieces are at least 1 MiB (an origin request costs a round trip) and at most
//! `[stage] part_size` (the request size the admin chose for the origin).
//!
//! The unit's hash stays what peers check, `blake3::hash` of the unit's bytes: each piece is
//! hashed on its own as a subtree of the unit's BLAKE3 tree, and the subtrees are merged once the
//! last piece is in (`blake3::hazmat`). That requires pieces of a power-of-two size, aligned in
//! the unit: every split of BLAKE3's tree above one piece then falls on a piece boundary (a left
//! subtree is the largest power of two shorter than its parent), so each piece is exactly one
//! subtree.

use blake3::hazmat::{ChainingValue, HasherExt, Mode, left_subtree_len};
use std::ops::Range;

/// How a unit of `len` bytes is read: pieces of `piece` bytes (a power of two), the last shorter.
#[derive(Debug)]
pub struct UnitPieces {
    len: u64,
    piece: u64,
    /// Each piece's chaining value once it is in; a unit of one piece keeps its hash instead.
    cvs: Vec<Option<ChainingValue>>,
    whole: Option<blake3::Hash>,
    left: usize,
}

impl UnitPieces {
    /// The piece size for units of `unit_size` read through `slots` budget slots, with origin
    /// requests of at most `part_size` (see the module header): `unit_size / slots`, at least
    /// 1 MiB and at most `part_size`, rounded down to a power of two.
    pub fn piece_size(unit_size: u64, slots: usize, part_size: u64) -> u64 {
        let want = (unit_size / slots.max(1) as u64).max(1 << 20);
        prev_power_of_two(want.min(part_size).max(blake3::CHUNK_LEN as u64))
    }

    /// The pieces of a unit of `len` bytes read `piece` bytes at a time.
    ///
    /// # Panics
    /// If `piece` is not a power of two of at least BLAKE3's chunk (1 KiB).
    pub fn new(len: u64, piece: u64) -> UnitPieces {
        assert!(
            piece.is_power_of_two() && piece >= blake3::CHUNK_LEN as u64,
            "a piece is a power of two of at least 1 KiB"
        );
        let n = len.div_ceil(piece).max(1) as usize;
        UnitPieces {
            len,
            piece,
            cvs: vec![None; n],
            whole: None,
            left: n,
        }
    }

    /// The pieces' byte ranges within the unit, in order.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + use<> {
        let (len, piece, n) = (self.len, self.piece, self.cvs.len() as u64);
        (0..n).map(move |i| i * piece..((i + 1) * piece).min(len))
    }

    /// The hasher for piece `i`'s bytes, in order.
    pub fn hasher(&self, i: usize) -> blake3::Hasher {
        let mut h = blake3::Hasher::new();
        if self.cvs.len() > 1 {
            h.set_input_offset(i as u64 * self.piece);
        }
        h
    }

    /// Takes piece `i`'s hasher once all of the piece's bytes went through it; the unit's hash
    /// when that was the last piece in.
    pub fn done(&mut self, i: usize, h: blake3::Hasher) -> Option<blake3::Hash> {
        if self.cvs.len() == 1 {
            self.whole = Some(h.finalize());
        } else {
            self.cvs[i] = Some(h.finalize_non_root());
        }
        self.left -= 1;
        if self.left > 0 {
            return None;
        }
        if let Some(hash) = self.whole {
            return Some(hash);
        }
        let l = left_subtree_len(self.len);
        Some(blake3::hazmat::merge_subtrees_root(
            &self.cv(0, l),
            &self.cv(l, self.len - l),
            Mode::Hash,
        ))
    }

    /// The chaining value of the subtree of `len` bytes at `offset`, from its pieces'.
    fn cv(&self, offset: u64, len: u64) -> ChainingValue {
        if len <= self.piece {
            return self.cvs[(offset / self.piece) as usize].expect("every piece is in");
        }
        let l = left_subtree_len(len);
        blake3::hazmat::merge_subtrees_non_root(
            &self.cv(offset, l),
            &self.cv(offset + l, len - l),
            Mode::Hash,
        )
    }
}

fn prev_power_of_two(n: u64) -> u64 {
    1 << (63 - n.leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Hashes `bytes` piece by piece, finishing the pieces in `order`.
    fn by_pieces(bytes: &[u8], piece: u64, order: &[usize]) -> blake3::Hash {
        let mut u = UnitPieces::new(bytes.len() as u64, piece);
        let ranges: Vec<_> = u.ranges().collect();
        assert_eq!(ranges.len(), order.len());
        let mut hash = None;
        for &i in order {
            let mut h = u.hasher(i);
            let r = &ranges[i];
            // In two updates, as a piece's bytes arrive in buffers.
            let mid = r.start + (r.end - r.start) / 3;
            h.update(&bytes[r.start as usize..mid as usize]);
            h.update(&bytes[mid as usize..r.end as usize]);
            assert!(hash.is_none(), "the hash comes with the last piece only");
            hash = u.done(i, h);
        }
        hash.expect("the last piece gives the unit's hash")
    }

    #[test]
    fn a_unit_read_as_pieces_in_any_order_hashes_as_blake3_of_its_bytes() {
        let bytes = data(300 * 1024 + 17);
        for len in [
            0,
            1,
            1024,
            1025,
            4096,
            8191,
            8192,
            8193,
            3 * 8192,
            5 * 8192 + 1,
            7 * 8192 - 1,
            16 * 8192,
            16 * 8192 + 1000,
            bytes.len(),
        ] {
            for piece in [1024u64, 8192, 16 * 1024, 64 * 1024, 1 << 20] {
                let n = UnitPieces::new(len as u64, piece).ranges().count();
                let forward: Vec<usize> = (0..n).collect();
                let backward: Vec<usize> = (0..n).rev().collect();
                let mut middle_out: Vec<usize> = (0..n).filter(|i| i % 2 == 1).collect();
                middle_out.extend((0..n).filter(|i| i % 2 == 0));
                for order in [forward, backward, middle_out] {
                    assert_eq!(
                        by_pieces(&bytes[..len], piece, &order),
                        blake3::hash(&bytes[..len]),
                        "len {len}, piece {piece}, order {order:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_unit_is_read_as_about_one_piece_per_slot_within_the_part_size() {
        const MIB: u64 = 1 << 20;
        // The defaults: 64 MiB units, 16 slots, 8 MiB parts.
        assert_eq!(UnitPieces::piece_size(64 * MIB, 16, 8 * MIB), 4 * MIB);
        // Small units: never below 1 MiB; the admin's part size caps it, rounded down.
        assert_eq!(UnitPieces::piece_size(16 * MIB, 16, 16 * MIB), MIB);
        assert_eq!(UnitPieces::piece_size(MIB, 64, 8 * MIB), MIB);
        assert_eq!(UnitPieces::piece_size(1 << 30, 16, 5 * MIB), 4 * MIB);
        assert_eq!(UnitPieces::piece_size(1 << 30, 4, 64 << 10), 64 << 10);

        let r: Vec<_> = UnitPieces::new(16 * MIB, 4 * MIB).ranges().collect();
        assert_eq!(r.len(), 4);
        assert_eq!(r[0], 0..4 * MIB);
        assert_eq!(r[3], 12 * MIB..16 * MIB);
        assert_eq!(
            UnitPieces::new(10 * MIB, 8 * MIB)
                .ranges()
                .collect::<Vec<_>>(),
            vec![0..8 * MIB, 8 * MIB..10 * MIB]
        );
        assert_eq!(UnitPieces::new(3 * MIB, 8 * MIB).ranges().count(), 1);
        assert_eq!(
            UnitPieces::new(0, 8 * MIB).ranges().collect::<Vec<_>>(),
            vec![0..0]
        );
    }
}
