//! `libsluice_writer.so`: how training code writes checkpoint files into `$SLUICE_CKPT_DIR`
//! quickly and the same way from Python and from any other language.
//!
//! - [`file`]: [`AlignedWriter`](file::AlignedWriter), one file written through a few 4 KiB-aligned
//!   buffers (`sluice_core::iobuf`, the buffers the agent's restore path uses; sluice-core is linked
//!   without its `runtime` feature, so no tokio in the training process) by a few writer
//!   threads at their own offsets, with `O_DIRECT` where the file system allows it, the unaligned
//!   tail last through the page cache, an fsync at close and a rename into place. It does not care
//!   which tier the directory is on.
//! - [`cufile`]: GPUDirect Storage: the probe (in a child process, with a deadline) and, where it
//!   says available, CUDA memory written to the file by `cuFileWrite`. `libcufile.so.0` is loaded
//!   at run time; nothing here links against CUDA.
//! - `ffi`: the C ABI (`include/sluice_writer.h`), used by the `sluice_ckpt` Python package
//!   through ctypes and by C/C++ programs.
//!
//! Committing a checkpoint is not this library's business: the caller runs `sluice ckpt commit
//! TAG` (the Python package does) once every file of the tag is closed.
//!
//! `unsafe` lives only at the FFI boundaries, `ffi` (the C ABI) and `cufile` (the calls into
//! libcufile); the aligned memory itself is `sluice_core::iobuf`'s.

#![deny(unsafe_code)]

pub mod cufile;
mod ffi;
pub mod file;

pub use file::{AlignedWriter, WriteError};
