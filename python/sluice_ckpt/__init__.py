"""sluice_ckpt: save checkpoints from training code into $SLUICE_CKPT_DIR and commit them.

One line with torch.distributed.checkpoint:

    dcp.save(state_dict, storage_writer=sluice_ckpt.SluiceWriter("step-100"))
    fut = dcp.async_save(state_dict, storage_writer=sluice_ckpt.SluiceWriter("step-200"))

or without DCP, from one rank:

    sluice_ckpt.save(state_dict, "step-100")
    fut = sluice_ckpt.save(state_dict, "step-200", async_=True)   # fut.result(): the path

and, when a step turns out bad (a NaN loss), so that no later job restores it as `latest`:

    sluice_ckpt.poison("step-200", "loss is NaN at step 230")

The asynchronous forms stall training for one copy of the state dict into buffers kept from save
to save (staging.py); the write and the commit run in the background.

Files are written by libsluice_writer.so (the `writer/` crate of sluice, over its C ABI with
ctypes): 4 KiB-aligned, several writer threads per file, O_DIRECT where the tier allows it,
fsynced and renamed into place; then the tag is committed with `sluice ckpt commit TAG` and the node's agent archives it.
"""

import os
import time

from . import deadline
from .deadline import end_time, save_cost, should_save, time_left
from ._lib import (
    SluiceError,
    Writer,
    ckpt_dir,
    commit,
    cufile_library,
    library_path,
    poison,
    probe_cufile,
)

__all__ = [
    "SluiceError",
    "SluiceReader",
    "Stager",
    "SluiceWriter",
    "Writer",
    "commit",
    "cufile_library",
    "default_stager",
    "end_time",
    "library_path",
    "load",
    "poison",
    "probe_cufile",
    "reserve",
    "save",
    "save_cost",
    "should_save",
    "time_left",
]

#: The file save() writes below the tag.
DEFAULT_FILE = "state.pt"


def save(
    state_dict,
    tag,
    *,
    filename=DEFAULT_FILE,
    ckpt_dir=None,
    commit=None,
    sluice=None,
    block_size=0,
    async_=False,
    stager=None,
):
    """torch.save(state_dict) into $SLUICE_CKPT_DIR/TAG/FILENAME through the aligned writer, fsynced,
    then `sluice ckpt commit TAG` (inside a Slurm job; commit=True/False forces it). Call it from one
    rank (the DDP pattern); the job's other nodes learn of the commit through the archive. Returns
    the file's path.

    async_=True: returns once the state dict is copied into the stager's buffers (stager: a
    sluice_ckpt.Stager; None: the process's default, kept from save to save), with a
    concurrent.futures.Future whose result() is the path once written, fsynced and committed (or
    raises what failed). The next asynchronous save waits, in its copy, for this one's write."""
    from . import _lib

    tag = _lib.check_tag(tag)
    d = os.path.join(_lib.ckpt_dir(ckpt_dir), tag)
    started = time.monotonic()
    if not async_:
        return _save(state_dict, d, tag, filename, commit, sluice, block_size, started=started)
    if stager is None:
        from .staging import default_stager

        stager = default_stager()
    staged, lease = stager.stage(state_dict)

    def run():
        try:
            return _save(staged, d, tag, filename, commit, sluice, block_size, lease, started)
        finally:
            lease.release()

    # The stager's one writer thread, started by its first save: handing it the write is a queue
    # put, where starting a thread per save made the caller wait for the new thread to take the
    # GIL and give it back (milliseconds of stall at every save).
    return stager.writer().submit(run)


def _save(state_dict, d, tag, filename, commit, sluice, block_size, lease=None, started=None):
    import torch

    from . import _lib

    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, filename)
    with Writer(path, block_size) as w:
        torch.save(state_dict, w)
    if lease is not None:
        lease.release()  # the bytes are in the file: the buffer may take the next save's copy
    _lib.fsync_dir(d)
    if _lib.should_commit(commit):
        _lib.commit(tag, sluice)
    if started is not None:
        deadline.record_save(time.monotonic() - started)
    return path


def load(tag, *, filename=DEFAULT_FILE, ckpt_dir=None, **torch_load_kwargs):
    """torch.load of what save() wrote (map_location="cpu" unless given)."""
    import torch

    from . import _lib

    torch_load_kwargs.setdefault("map_location", "cpu")
    path = os.path.join(_lib.ckpt_dir(ckpt_dir), _lib.check_tag(tag), filename)
    return torch.load(path, **torch_load_kwargs)


def __getattr__(name):
    # What needs torch is imported only when asked for: the DCP pair (torch.distributed.checkpoint)
    # and the stager, so that a process without torch can use the writer and commit (torch is not
    # a dependency of this package).
    if name in ("SluiceWriter", "SluiceReader", "SluiceFileSystem"):
        from . import dcp

        return getattr(dcp, name)
    if name in ("Stager", "default_stager", "reserve"):
        from . import staging

        return getattr(staging, name)
    raise AttributeError(f"module 'sluice_ckpt' has no attribute {name!r}")
