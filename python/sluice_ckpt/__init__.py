"""sluice_ckpt: save checkpoints from training code into $SLUICE_CKPT_DIR and commit them.

One line with torch.distributed.checkpoint:

    dcp.save(state_dict, storage_writer=sluice_ckpt.SluiceWriter("step-100"))

or without DCP, from one rank:

    sluice_ckpt.save(state_dict, "step-100")

Files are written by libsluice_writer.so (the `writer/` crate of sluice, over its C ABI with
ctypes): 4 KiB-aligned, double-buffered, O_DIRECT where the tier allows it, fsynced; then the tag is
committed with `sluice ckpt commit TAG` and the node's agent archives it.
"""

import os

from ._lib import (
    SluiceError,
    Writer,
    ckpt_dir,
    commit,
    cufile_library,
    library_path,
    probe_cufile,
)

__all__ = [
    "SluiceError",
    "SluiceReader",
    "SluiceWriter",
    "Writer",
    "commit",
    "cufile_library",
    "library_path",
    "load",
    "probe_cufile",
    "save",
]

#: The file save() writes below the tag.
DEFAULT_FILE = "state.pt"


def save(state_dict, tag, *, filename=DEFAULT_FILE, ckpt_dir=None, commit=None, sluice=None, block_size=0):
    """torch.save(state_dict) into $SLUICE_CKPT_DIR/TAG/FILENAME through the aligned writer, fsynced,
    then `sluice ckpt commit TAG` (inside a Slurm job; commit=True/False forces it). Call it from one
    rank (the DDP pattern); the job's other nodes learn of the commit through the archive. Returns
    the file's path."""
    import torch

    from . import _lib

    d = os.path.join(_lib.ckpt_dir(ckpt_dir), _lib.check_tag(tag))
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, filename)
    with Writer(path, block_size) as w:
        torch.save(state_dict, w)
    _lib.fsync_dir(d)
    if _lib.should_commit(commit):
        _lib.commit(_lib.check_tag(tag), sluice)
    return path


def load(tag, *, filename=DEFAULT_FILE, ckpt_dir=None, **torch_load_kwargs):
    """torch.load of what save() wrote (map_location="cpu" unless given)."""
    import torch

    from . import _lib

    torch_load_kwargs.setdefault("map_location", "cpu")
    path = os.path.join(_lib.ckpt_dir(ckpt_dir), _lib.check_tag(tag), filename)
    return torch.load(path, **torch_load_kwargs)


def __getattr__(name):
    # The DCP pair imports torch.distributed.checkpoint: only when asked for.
    if name in ("SluiceWriter", "SluiceReader", "SluiceFileSystem"):
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'sluice_ckpt' has no attribute {name!r}")
