/*
 * sluice_writer.h — the C ABI of libsluice_writer.so (crate writer/ of sluice).
 *
 * Writes checkpoint files into $SLUICE_CKPT_DIR/TAG/ through 4 KiB-aligned buffers: a few writer
 * threads write blocks at their own offsets while the caller fills the next one, with O_DIRECT
 * where the file system takes it (else through the page cache: tmpfs before Linux 6.6), the
 * unaligned tail through the page cache, last, and an fsync at close. Until close succeeds the
 * file is written under a hidden temporary name beside PATH (.NAME.PID.SEQ.tmp); close fsyncs it,
 * renames it to PATH and fsyncs the directory. A failed close or an abort removes it, so PATH never
 * holds a partly written file (a PATH that exists and is not a regular file, such as /dev/null or
 * a symbolic link, is written in place). CUDA device memory can be written straight
 * to the file with GPUDirect Storage (cuFile) where sluice_cufile_probe says it is available.
 *
 * Committing is the caller's: when every file of TAG is closed, run `sluice ckpt commit TAG`.
 *
 * Build: cargo build --release -p sluice-writer   ->  target/release/libsluice_writer.so and
 *        target/release/sluice-cufile-probe (keep the two side by side).
 * Link:  cc prog.c -I writer/include -L target/release -lsluice_writer
 *
 * Errors: functions returning int return 0 on success and a negative errno on failure (-ENOSPC,
 * -EIO, -EINVAL for a bad argument, -EOPNOTSUPP where cuFile cannot write); the message is then
 * in sluice_writer_last_error(). A writer is used by one thread at a time; different writers may
 * be used by different threads at once.
 */
#ifndef SLUICE_WRITER_H
#define SLUICE_WRITER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One file being written. */
typedef struct sluice_writer sluice_writer;

/* Starts writing PATH (mode 0644 before the umask; it replaces PATH at close) and returns its
 * writer; NULL on failure (see sluice_writer_last_error). BLOCK_SIZE: bytes per block, rounded up
 * to 4096; 0 = 8 MiB. Written by the default number of writer threads: $SLUICE_WRITER_THREADS
 * (1 to 64) if set, else 2. */
sluice_writer *sluice_writer_open(const char *path, size_t block_size);

/* sluice_writer_open with THREADS writer threads (1 to 64; 0 = the default above; more is refused
 * with -EINVAL). A thread is started only while every running one has a block to write, and the
 * writer holds at most THREADS + 1 blocks of memory, allocated as the bytes arrive: a file of one
 * block uses one thread and one block whatever THREADS says. */
sluice_writer *sluice_writer_open_threads(const char *path, size_t block_size, unsigned threads);

/* Appends LEN bytes at BUF (host memory). They are copied before the call returns, so BUF may be
 * reused at once. Blocks only while the writer threads hold every other block. */
int sluice_writer_write(sluice_writer *w, const void *buf, size_t len);

/* Appends LEN bytes of CUDA device memory at DEVPTR with cuFileWrite (GPU -> file, no bounce
 * buffer), after writing out what was buffered. Only after sluice_cufile_probe returned 1 in this
 * process, and only on a file opened with O_DIRECT (sluice_writer_is_direct); else -EOPNOTSUPP and
 * nothing is written: copy the memory to the host (a pinned buffer) and use sluice_writer_write.
 * Keep the bytes before it a multiple of 4096 for GDS to write without its own bounce buffers. */
int sluice_writer_write_cuda(sluice_writer *w, const void *devptr, size_t len);

/* The bytes appended so far (the file's length once closed); a negative errno on failure. */
int64_t sluice_writer_position(sluice_writer *w);

/* 1 if the file was opened with O_DIRECT, 0 if it is written through the page cache. */
int sluice_writer_is_direct(sluice_writer *w);

/* Writes the rest, waits for the writer threads, fsyncs, renames the file to PATH and fsyncs the
 * directory; frees W whatever the result. 0: the file is complete and durable under PATH. On an
 * error (any write, the fsync, the rename) PATH holds what it held before the open. */
int sluice_writer_close(sluice_writer *w);

/* Frees W without finishing the file (an error path): nothing more is written, the unfinished file
 * is removed and PATH holds what it held before the open. NULL is ignored. */
void sluice_writer_abort(sluice_writer *w);

/* The message of this thread's last failure ("" if none); valid until its next failing call. */
const char *sluice_writer_last_error(void);

/* The library's version, e.g. "0.1.0". */
const char *sluice_writer_version(void);

/* Whether GPUDirect Storage can be used here: loads LIB (NULL = "libcufile.so.0" on the loader's
 * path) and opens the cuFile driver in a child process (sluice-cufile-probe, beside this library,
 * or $SLUICE_CUFILE_PROBE) with compat mode off, killed after TIMEOUT_MS (0 = 10000: where GDS is
 * set up, opening the driver creates a CUDA context, which can take seconds; where it is not, the
 * answer comes at once). Returns 1 (available) or 0 (unavailable), and writes a one-line reason to
 * WHY (NUL-terminated, cut to WHY_LEN; WHY may be NULL): "available (libcufile 1170)",
 * "unavailable: libcufile.so.0 not found", "unavailable: cuFileDriverOpen failed: error 5001: ...".
 * Never hangs: with the default configuration cuFileDriverOpen never returns on a machine without
 * the nvidia-fs driver. */
int sluice_cufile_probe(const char *lib, unsigned timeout_ms, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_WRITER_H */
