//! 4 KiB-aligned, reusable I/O buffers: the memory that `O_DIRECT` reads and writes go through, and
//! that GPUDirect Storage (cuFile) will register, both of which need the buffer's address, the file
//! offset and the length to be multiples of the logical block size. Restore decodes each chunk into
//! one of these and writes its whole blocks straight to the disk (sluice-archive's download.rs); the
//! RAM tier's flush and the checkpoint writer (sluice-writer) reuse them.
//!
//! This module is the one place in sluice-core where `unsafe` is allowed: a `Vec<u8>` is aligned only by luck, and the global allocator hands out aligned memory only through
//! a [`Layout`], which the same layout must then free. Every block argues its safety from the
//! invariants stated on [`AlignedBuf`]. Plain `std::alloc` rather than a crate: the whole of it is
//! one allocation, one free and two slice views, and a `Vec` of `#[repr(align(4096))]` blocks would
//! still need `unsafe` (or a casting crate) to be seen as bytes. Buffers are zeroed once, when
//! allocated, so every byte is initialised and any prefix can be handed out safely; reuse then costs
//! nothing.

use std::alloc::{Layout, alloc_zeroed, dealloc, handle_alloc_error};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The alignment of every [`AlignedBuf`]'s address and capacity: the logical block size `O_DIRECT`
/// needs on the file systems of a hot tier (ext4, XFS on 512e and 4Kn disks) and the alignment
/// cuFile needs for registered buffers, file offsets and sizes.
pub const ALIGN: usize = 4096;

/// `len` rounded up to a multiple of [`ALIGN`]. Panics when that overflows `usize`.
pub const fn round_up(len: usize) -> usize {
    match len.checked_next_multiple_of(ALIGN) {
        Some(n) => n,
        None => panic!("aligned buffer length overflows usize"),
    }
}

/// Whether `offset` (in a file, or a length) is a multiple of [`ALIGN`].
pub const fn is_aligned(offset: u64) -> bool {
    offset.is_multiple_of(ALIGN as u64)
}

/// What an empty buffer points at: never allocated, never read, only aligned.
#[repr(C, align(4096))]
struct Block([u8; ALIGN]);

/// A heap buffer whose address is a multiple of [`ALIGN`], with a length (the bytes in use) and a
/// capacity (the bytes allocated, a multiple of [`ALIGN`]). It derefs to `[u8]` of its length.
///
/// Unlike a `Vec<u8>` it never moves its contents: [`reuse`](Self::reuse) keeps the allocation when
/// it is large enough and otherwise replaces it with a larger zeroed one, so a thread can decode
/// chunk after chunk into one buffer without zeroing or faulting in its pages each time.
///
/// Invariants, which every `unsafe` block below relies on:
/// - `len <= cap`, and `cap` is a multiple of [`ALIGN`] no larger than `isize::MAX`;
/// - `cap == 0`: nothing is allocated, `ptr` is a dangling but non-null pointer aligned to [`ALIGN`];
/// - `cap > 0`: `ptr` came from `alloc_zeroed(Layout::from_size_align(cap, ALIGN))`, this value alone
///   owns it, and all `cap` bytes are initialised (zeroed then, written since only through `&mut [u8]`
///   borrows of this buffer).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: an `AlignedBuf` owns its allocation exclusively, as a `Box<[u8]>` does, and has no
// interior mutability: moving it to another thread moves that ownership, and the allocator may free
// memory on a thread other than the one that allocated it.
unsafe impl Send for AlignedBuf {}
// SAFETY: through `&AlignedBuf` the bytes can only be read (`as_slice`, `Deref`); writing needs
// `&mut AlignedBuf`. Sharing references across threads is then as sound as for `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of length and capacity 0 that allocates nothing; [`reuse`](Self::reuse) gives it
    /// memory when first needed. Usable in a `const` (a `thread_local!` initialiser).
    pub const fn empty() -> AlignedBuf {
        AlignedBuf {
            ptr: NonNull::<Block>::dangling().cast::<u8>(),
            len: 0,
            cap: 0,
        }
    }

    /// A zeroed buffer of `len` bytes rounded up to a multiple of [`ALIGN`]: its length and its
    /// capacity. `new(0)` allocates nothing.
    pub fn new(len: usize) -> AlignedBuf {
        let cap = round_up(len);
        AlignedBuf {
            ptr: allocate(cap),
            len: cap,
            cap,
        }
    }

    /// The bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes allocated: a multiple of [`ALIGN`], at least [`len`](Self::len).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The first byte's address, a multiple of [`ALIGN`] (for a cuFile registration or an
    /// alignment check).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: by the invariants `ptr` is non-null and aligned, and the first `len` bytes behind it
        // are allocated (or `len` is 0), initialised and owned by `self`; `len <= isize::MAX`. The
        // slice borrows `self`, so the memory outlives it and cannot be written meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; the slice borrows `self` mutably, so it is the only access to
        // these bytes while it lives, and whatever is written through it keeps them initialised.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Makes the buffer `len` bytes long for new contents and returns them, to be filled. The
    /// allocation is kept when its capacity suffices, and the bytes are then whatever they last
    /// held (nothing is zeroed or copied); otherwise it is replaced by a zeroed one of `len` rounded
    /// up to [`ALIGN`]. Either way the old contents are not to be relied on.
    pub fn reuse(&mut self, len: usize) -> &mut [u8] {
        if len > self.cap {
            // Freed before the larger one is allocated: the two never coexist.
            *self = AlignedBuf::empty();
            *self = AlignedBuf::new(len);
        }
        self.len = len;
        self.as_mut_slice()
    }

    /// Shortens the buffer to `len` bytes, keeping the allocation; no effect when it is not longer.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The length rounded down to a multiple of [`ALIGN`]: the bytes `O_DIRECT` can write at an
    /// aligned offset in one go.
    pub fn aligned_len(&self) -> usize {
        self.len / ALIGN * ALIGN
    }

    /// The bytes after the last whole block (`len % ALIGN`), which `O_DIRECT` cannot write.
    pub fn tail_len(&self) -> usize {
        self.len % ALIGN
    }

    /// The whole blocks, `[..aligned_len()]`: aligned in memory and in length.
    pub fn blocks(&self) -> &[u8] {
        &self.as_slice()[..self.aligned_len()]
    }

    /// The bytes after the whole blocks, `[aligned_len()..]`.
    pub fn tail(&self) -> &[u8] {
        &self.as_slice()[self.aligned_len()..]
    }
}

/// `Layout` of an allocation of `cap` bytes (a multiple of [`ALIGN`]).
fn layout(cap: usize) -> Layout {
    Layout::from_size_align(cap, ALIGN).expect("aligned buffer larger than isize::MAX")
}

/// `cap` zeroed bytes aligned to [`ALIGN`], or the dangling pointer of [`AlignedBuf::empty`] for 0.
fn allocate(cap: usize) -> NonNull<u8> {
    if cap == 0 {
        return AlignedBuf::empty().ptr;
    }
    let layout = layout(cap);
    // SAFETY: `layout` has a non-zero size (`cap > 0`), which is all `alloc_zeroed` requires; a null
    // return (out of memory) is handled below, never dereferenced.
    let ptr = unsafe { alloc_zeroed(layout) };
    NonNull::new(ptr).unwrap_or_else(|| handle_alloc_error(layout))
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: by the invariants `ptr` came from `alloc_zeroed` with exactly this layout
            // (`cap` bytes, aligned to `ALIGN`), this value alone owns it, and it is freed only here,
            // once: no slice of it outlives `self`.
            unsafe { dealloc(self.ptr.as_ptr(), layout(self.cap)) };
        }
    }
}

impl Default for AlignedBuf {
    fn default() -> AlignedBuf {
        AlignedBuf::empty()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// Length and capacity, not the contents (a buffer may hold megabytes).
impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{DIRECT_IO_REFUSED, direct_io_dir};

    const SIZES: [usize; 9] = [0, 1, 100, 4095, 4096, 4097, 65536, 1 << 20, (4 << 20) + 5];

    #[test]
    fn every_buffer_is_aligned_zeroed_and_rounded_up_to_whole_blocks() {
        for size in SIZES {
            let buf = AlignedBuf::new(size);
            assert_eq!(buf.as_ptr() as usize % ALIGN, 0, "address of new({size})");
            assert_eq!(
                buf.len(),
                size.div_ceil(ALIGN) * ALIGN,
                "len of new({size})"
            );
            assert_eq!(buf.capacity(), buf.len(), "capacity of new({size})");
            assert!(buf.len() >= size);
            assert!(buf.iter().all(|&b| b == 0), "new({size}) is not zeroed");
            assert_eq!(buf.tail_len(), 0);
            assert_eq!(buf.blocks().len(), buf.len());
        }
        assert_eq!(round_up(1), ALIGN);
        assert_eq!(round_up(ALIGN), ALIGN);
        assert_eq!(round_up(ALIGN + 1), 2 * ALIGN);
        assert!(AlignedBuf::new(0).is_empty());
        assert_eq!(AlignedBuf::empty().as_ptr() as usize % ALIGN, 0);
        assert!(AlignedBuf::empty().as_slice().is_empty());
    }

    #[test]
    fn reuse_keeps_a_large_enough_allocation_and_replaces_a_small_one() {
        let mut buf = AlignedBuf::empty();
        let first = buf.reuse(10_000);
        assert_eq!(first.len(), 10_000);
        assert!(first.iter().all(|&b| b == 0));
        first.fill(0xab);
        assert_eq!(buf.capacity(), 3 * ALIGN);
        let at = buf.as_ptr();

        // Smaller, then as large as the capacity: same memory, not zeroed, split into blocks + tail.
        assert_eq!(buf.reuse(5000).len(), 5000);
        assert_eq!(buf.as_ptr(), at);
        assert!(buf.iter().all(|&b| b == 0xab));
        assert_eq!((buf.aligned_len(), buf.tail_len()), (ALIGN, 5000 - ALIGN));
        assert_eq!(buf.blocks().len() + buf.tail().len(), 5000);
        assert_eq!(buf.reuse(3 * ALIGN).len(), 3 * ALIGN);
        assert_eq!(buf.as_ptr(), at);
        assert_eq!(buf.capacity(), 3 * ALIGN);

        // Larger than the capacity: a new aligned, zeroed allocation, rounded up.
        let grown = buf.reuse(3 * ALIGN + 1);
        assert!(grown.iter().all(|&b| b == 0));
        assert_eq!(buf.len(), 3 * ALIGN + 1);
        assert_eq!(buf.capacity(), 4 * ALIGN);
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        assert_eq!(buf.tail(), [0]);

        buf.truncate(ALIGN);
        assert_eq!((buf.len(), buf.capacity()), (ALIGN, 4 * ALIGN));
        buf.truncate(2 * ALIGN);
        assert_eq!(buf.len(), ALIGN);

        let mut writes = AlignedBuf::new(8);
        writes[7] = 1;
        assert_eq!(writes.as_slice()[7], 1);
        assert_eq!(writes.as_ref().len(), ALIGN);
    }

    #[test]
    fn buffers_move_between_threads() {
        let mut buf = AlignedBuf::new(ALIGN);
        buf.fill(7);
        let back = std::thread::spawn(move || {
            assert!(buf.iter().all(|&b| b == 7));
            buf
        })
        .join()
        .unwrap();
        assert_eq!(back.len(), ALIGN);
    }

    /// Writes whole aligned blocks from an `AlignedBuf` with `O_DIRECT` and reads them back. The
    /// temporary file sits in the target directory (beside the test binary), not in `/tmp`, which is
    /// often a tmpfs: tmpfs before Linux 6.6 refuses `O_DIRECT` with `EINVAL`, which the restore
    /// path answers by writing through the page cache. Where the target directory's file system
    /// refuses it too, the test fails and says so: the aligned write would go unchecked.
    #[test]
    fn an_aligned_buffer_can_be_written_with_o_direct() {
        use std::io::Read;
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let dir = direct_io_dir();
        let path = dir.path().join("direct");
        let mut buf = AlignedBuf::new(3 * ALIGN);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(nix::libc::O_DIRECT)
            .open(&path);
        let written = opened.and_then(|f| {
            f.write_all_at(buf.blocks(), ALIGN as u64)?;
            f.sync_all()
        });
        if let Err(e) = written {
            assert_eq!(
                e.raw_os_error(),
                Some(nix::libc::EINVAL),
                "O_DIRECT write: {e}"
            );
            panic!("{DIRECT_IO_REFUSED} ({})", dir.path().display());
        }
        let mut back = Vec::new();
        std::fs::File::open(&path)
            .unwrap()
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back.len(), 4 * ALIGN);
        assert!(back[..ALIGN].iter().all(|&b| b == 0), "hole before offset");
        assert_eq!(&back[ALIGN..], buf.as_slice());
    }
}
