"""A torch.distributed.checkpoint storage pair that writes through libsluice_writer and commits.

    dcp.save(state_dict, storage_writer=sluice_ckpt.SluiceWriter("step-100"))
    fut = dcp.async_save(state_dict, storage_writer=sluice_ckpt.SluiceWriter("step-200"))
    dcp.load(state_dict, storage_reader=sluice_ckpt.SluiceReader("step-100"))

SluiceWriter is DCP's FileSystemWriter (same files, same layout: `__R_N.distcp` per rank and
`.metadata`, so the agent's DCP signal and every DCP reader understand it) with a file system whose
write streams are libsluice_writer files: 4 KiB-aligned blocks, written by a few writer threads
while DCP fills the next, O_DIRECT where the tier allows it, fsynced at close. When the save completes
(`finish`, on the coordinator, after every rank wrote), it fsyncs the directory and runs
`sluice ckpt commit TAG` (inside a Slurm job; `commit=` overrides): the commit the agent's
`.metadata` signal would also see, at once rather than at its next scan.

Under dcp.async_save, SluiceWriter is also the stager (DCP uses a storage writer that is an
AsyncStager as its stager): the training thread's only work is one copy of the state dict into
buffers kept from save to save (the process's sluice_ckpt.staging.default_stager(): pinned when
CUDA is there, pages faulted in by the first save), and async_save returns; the write, the
metadata and the commit run in DCP's background thread. A second async_save waits, in its copy,
for the first's write to have returned before overwriting the buffer (see staging.py).
`stager=False` gives DCP's own staging (a fresh copy at every save); `stager=Stager()` a buffer
of its own (for a second state dict saved alternately with the first).

Tensors reach the streams as DCP stages them: on the host (DCP copies CUDA tensors to the CPU
first — under async_save into the staging copy; that copy is the bounce buffer on this path).
For CUDA tensors straight to the file through GPUDirect Storage use `Writer.write_tensor`.
"""

import io
import os
import threading
import time
import weakref
from contextlib import contextmanager

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from . import _lib, deadline
from .staging import default_stager


class _Stream(io.RawIOBase):
    """A write-only binary stream over one libsluice_writer file, as DCP's create_stream yields."""

    def __init__(self, path, block_size):
        super().__init__()
        self._w = _lib.Writer(path, block_size)

    def writable(self):
        return True

    def write(self, b):
        return self._w.write(b)

    def tell(self):
        return self._w.tell()

    def seekable(self):
        return False

    def fileno(self):
        # The descriptor is the library's (with O_DIRECT); close() fsyncs it.
        raise io.UnsupportedOperation("fileno: sluice streams fsync when they close")

    def close(self):
        if not self.closed:
            try:
                self._w.close()
            finally:
                super().close()

    def abort(self):
        self._w.abort()
        super().close()


class SluiceFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams go through libsluice_writer."""

    def __init__(self, block_size=0):
        super().__init__()
        self.block_size = block_size

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        stream = _Stream(os.fspath(path), self.block_size)
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        stream.close()


def _tag_dir(tag, ckpt_dir):
    return os.path.join(_lib.ckpt_dir(ckpt_dir), _lib.check_tag(tag))


class SluiceWriter(FileSystemWriter):
    """DCP StorageWriter into $SLUICE_CKPT_DIR/TAG, committing TAG when the save completes.

    tag: the checkpoint's name (one directory name). ckpt_dir: instead of $SLUICE_CKPT_DIR.
    commit: None (default) commits inside a Slurm job (SLURM_JOB_ID set) and not elsewhere;
    True/False force it. sluice: the CLI's path (else $SLUICE_CLI, else PATH). block_size: the
    writer's block (0: 8 MiB). Other keywords go to FileSystemWriter (thread_count, ...);
    sync_files is always off: every stream is fsynced when it closes. stager: what
    dcp.async_save's copy goes through (None: the process's default Stager, kept from save to
    save; False: DCP's own fresh copy; or a sluice_ckpt.Stager).
    """

    def __init__(self, tag, *, ckpt_dir=None, commit=None, sluice=None, block_size=0, stager=None, **kwargs):
        self.tag = _lib.check_tag(tag)
        kwargs["sync_files"] = False
        super().__init__(_tag_dir(tag, ckpt_dir), **kwargs)
        self.fs = SluiceFileSystem(block_size)
        self.commit = commit
        self.sluice = sluice
        self.commit_output = None
        self.stager = stager
        self._lease = None
        self._staging_thread = None
        self._started = None  # when this save began (its staging, or its reset): for should_save()

    def stage(self, state_dict):
        """dcp.async_save's staging (on the training thread): one copy into the kept buffers."""
        if self.stager is False:
            return super().stage(state_dict)
        self._started = time.monotonic()
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the state is on the host now
        stager = self.stager if self.stager is not None else default_stager()
        staged, lease = stager.stage(state_dict)
        self._lease = lease
        self._staging_thread = threading.current_thread()
        # Dropped without a write (async_save failed before its thread started): free the buffer.
        weakref.finalize(self, lease.release)
        return staged

    def _bind_lease(self):
        # The hooks below run in async_save's thread: its end releases the buffer even where the
        # save fails before write_data returns.
        if self._lease is not None and threading.current_thread() is not self._staging_thread:
            self._lease.bind(threading.current_thread())

    def _begin(self):
        if self._started is None:
            self._started = time.monotonic()

    def reset(self, checkpoint_id=None):
        self._begin()
        self._bind_lease()
        super().reset(checkpoint_id)

    def set_up_storage_writer(self, *args, **kwargs):
        self._begin()
        self._bind_lease()
        return super().set_up_storage_writer(*args, **kwargs)

    def prepare_local_plan(self, plan):
        self._bind_lease()
        return super().prepare_local_plan(plan)

    def write_data(self, plan, planner):
        self._bind_lease()
        fut = super().write_data(plan, planner)
        # This rank's bytes are in its files: the buffer may take the next save's copy.
        if self._lease is not None:
            lease = self._lease
            fut.add_done_callback(lambda _f: lease.release())
        return fut

    def finish(self, metadata, results):
        super().finish(metadata, results)
        # The .metadata rename (and every shard file's creation) durable before the commit.
        _lib.fsync_dir(os.fspath(self.path))
        if _lib.should_commit(self.commit):
            self.commit_output = _lib.commit(os.path.basename(os.fspath(self.path)), self.sluice)
        if self._started is not None:
            deadline.record_save(time.monotonic() - self._started)
            self._started = None


class SluiceReader(FileSystemReader):
    """DCP StorageReader of $SLUICE_CKPT_DIR/TAG (e.g. the tag --ckpt-restore put back:
    SluiceReader(os.environ["SLUICE_RESTORED_TAG"]))."""

    def __init__(self, tag, *, ckpt_dir=None, **kwargs):
        self.tag = _lib.check_tag(tag)
        super().__init__(_tag_dir(tag, ckpt_dir), **kwargs)
