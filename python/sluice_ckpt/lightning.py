"""PyTorch Lightning adopts sluice in one line (issue 27):

    trainer = L.Trainer(plugins=[SluiceCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=os.environ["SLUICE_CKPT_DIR"],
                                                   filename="step-{step}", auto_insert_metric_name=False,
                                                   every_n_train_steps=1000, save_top_k=-1)])
    trainer.fit(model, ckpt_path=restored_checkpoint())   # None on a first run: starts fresh

Every checkpoint Lightning saves as DIR/NAME.ckpt goes, through the sluice writer, into the tag
directory DIR/NAME/NAME.ckpt and is committed there (inside a Slurm job), so the node's agent
archives it and `--ckpt-restore=latest` brings it back; `restored_checkpoint()` is the path of what
the job's restore put back. Asynchronous by default: the save stalls training for one copy into
buffers kept from save to save (a Stager), the write and the commit run in the background, and a
failed one is raised at the next save or when the trainer ends.

Lightning's own deletions of old checkpoints (`save_top_k`) are left to sluice: the hot tier's
retention (`--ckpt-keep`) removes archived checkpoints and never an unarchived one, which a delete
from the trainer could not know. Tag names are the file names' stems with characters other than
letters, digits, `.`, `_`, `+` and `-` made `_` (Lightning's default `epoch=0-step=50` becomes
`epoch_0-step_50`).

`SluiceFinalSave(margin=120)` among the callbacks saves once more and stops when the job's time
limit comes closer than one save plus the margin (`sluice_ckpt.should_save`, as rank 0 sees it).
"""

import os
import re
import sys

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.plugins.io import CheckpointIO

from . import _lib, deadline

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


def tag_of(path):
    """The sluice tag of Lightning's checkpoint file `path`: its stem, made a tag name."""
    stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    tag = _UNSAFE.sub("_", stem).lstrip(".") or "checkpoint"
    return tag


def _stored(path):
    """Where the file Lightning calls `path` is: DIR/TAG/NAME (or `path` itself, when it is a file,
    e.g. the one restored_checkpoint() names)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    return os.path.join(os.path.dirname(path), tag_of(path), os.path.basename(path))


def restored_checkpoint(ckpt_dir=None):
    """The checkpoint file `--ckpt-restore` put back ($SLUICE_RESTORED_TAG in $SLUICE_CKPT_DIR), for
    `trainer.fit(..., ckpt_path=...)`; None when the job restored nothing (a first run)."""
    tag = os.environ.get("SLUICE_RESTORED_TAG")
    if not tag:
        return None
    d = os.path.join(_lib.ckpt_dir(ckpt_dir), _lib.check_tag(tag))
    files = sorted(f for f in os.listdir(d) if f.endswith(".ckpt"))
    if len(files) != 1:
        raise _lib.SluiceError(
            2, f"restored checkpoint {tag}: expected one .ckpt file in {d}, found {files or 'none'}"
        )
    return os.path.join(d, files[0])


class SluiceCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO through sluice: each checkpoint written by the sluice writer into
    its own tag directory and committed (see the module's text). async_: False saves on the
    training thread; stager: the sluice_ckpt.Stager of the asynchronous saves (None: the process's
    default); commit/sluice as for sluice_ckpt.save."""

    def __init__(self, async_=True, stager=None, commit=None, sluice=None):
        super().__init__()
        self.async_ = async_
        self.stager = stager
        self.commit = commit
        self.sluice = sluice
        self._pending = []
        self._said_remove = False

    def _settle(self, wait):
        """Raises what a finished (or, with wait, any) earlier save failed with."""
        still = []
        for f in self._pending:
            if wait or f.done():
                f.result()
            else:
                still.append(f)
        self._pending = still

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if storage_options is not None:
            raise TypeError("SluiceCheckpointIO takes no storage_options")
        self._settle(wait=False)
        import sluice_ckpt

        path = os.fspath(path)
        tag = tag_of(path)
        result = sluice_ckpt.save(
            checkpoint,
            tag,
            filename=os.path.basename(path),
            ckpt_dir=os.path.dirname(path) or ".",
            commit=self.commit,
            sluice=self.sluice,
            async_=self.async_,
            stager=self.stager,
        )
        if self.async_:
            self._pending.append(result)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        import torch

        self._settle(wait=True)  # a checkpoint being written is read whole or not at all
        return torch.load(_stored(path), map_location=map_location, weights_only=bool(weights_only))

    def remove_checkpoint(self, path):
        # Left to sluice's retention, which never removes a checkpoint that is not archived.
        if not self._said_remove:
            self._said_remove = True
            print(
                f"sluice_ckpt: Lightning's removal of {tag_of(path)} (save_top_k) is left to sluice: "
                "its retention (--ckpt-keep) removes archived checkpoints from the hot tier, never one "
                "that is not archived yet",
                file=sys.stderr,
            )

    def teardown(self):
        self._settle(wait=True)


class SluiceFinalSave(Callback):
    """Saves once more (DIRPATH/FILENAME.ckpt, FILENAME formatted with step=) and stops training
    when the job's time limit comes closer than one save plus `margin` seconds, as rank 0 sees it.
    dirpath: default $SLUICE_CKPT_DIR."""

    def __init__(self, margin=120.0, dirpath=None, filename="step-{step}"):
        super().__init__()
        self.margin = margin
        self.dirpath = dirpath
        self.filename = filename
        self.final_step = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        due = deadline.should_save(margin=self.margin)
        if not trainer.strategy.broadcast(due, src=0):
            return
        step = trainer.global_step
        path = os.path.join(self.dirpath or _lib.ckpt_dir(None), self.filename.format(step=step) + ".ckpt")
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        self.final_step = step
        if trainer.is_global_zero:
            print(f"sluice_ckpt: final save before the time limit: {tag_of(path)}", file=sys.stderr, flush=True)
