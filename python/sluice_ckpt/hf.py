"""The Hugging Face Trainer adopts sluice in one line (issue 27):

    args = TrainingArguments(output_dir=os.environ["SLUICE_CKPT_DIR"], save_steps=1000, ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SluiceCallback()])
    trainer.train(resume_from_checkpoint=restored_checkpoint())   # None on a first run

The Trainer writes each checkpoint as `output_dir/checkpoint-STEP/`; the callback commits that tag
(from the main process once every rank wrote its part, inside a Slurm job) so the node's agent archives it, and
`restored_checkpoint()` is the directory `--ckpt-restore` put back. With `final_save_margin` (seconds)
it also saves once more and stops when the job's time limit comes closer than one save plus the
margin (`sluice_ckpt.should_save`, which learns what a save takes from the Trainer's own saves).

Leave `save_total_limit` unset: the Trainer's rotation deletes old checkpoint directories whether
or not they are archived; sluice's retention (`--ckpt-keep`) removes only archived ones.
"""

import os
import sys
import time

from transformers import TrainerCallback

from . import _lib, deadline


def restored_checkpoint(ckpt_dir=None):
    """The checkpoint directory `--ckpt-restore` put back, for
    `trainer.train(resume_from_checkpoint=...)`; None when the job restored nothing."""
    tag = os.environ.get("SLUICE_RESTORED_TAG")
    if not tag:
        return None
    return os.path.join(_lib.ckpt_dir(ckpt_dir), _lib.check_tag(tag))


def _barrier(args):
    if args.world_size <= 1:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class SluiceCallback(TrainerCallback):
    """Commits every checkpoint the Trainer saves (see the module's text). final_save_margin: None
    (default) leaves the time limit alone; seconds: save once more and stop when the job's limit
    comes closer than one save plus that. commit/sluice as for sluice_ckpt.save."""

    def __init__(self, final_save_margin=None, commit=None, sluice=None):
        self.final_save_margin = final_save_margin
        self.commit = commit
        self.sluice = sluice
        self._save_started = None
        self.final_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and args.save_total_limit:
            print(
                f"sluice_ckpt: save_total_limit={args.save_total_limit} makes the Trainer delete "
                "checkpoints that may not be archived yet; leave it unset and let sluice's retention "
                "(--ckpt-keep) trim the hot tier",
                file=sys.stderr,
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self.final_save_margin is not None and deadline.should_save_everywhere(self.final_save_margin):
            control.should_save = True
            control.should_training_stop = True
            self.final_step = state.global_step
            if state.is_world_process_zero:
                print(f"sluice_ckpt: final save before the time limit: step {state.global_step}",
                      file=sys.stderr, flush=True)
        if control.should_save:
            self._save_started = time.monotonic()
        return control

    def on_save(self, args, state, control, **kwargs):
        if self._save_started is not None:
            deadline.record_save(time.monotonic() - self._save_started)
            self._save_started = None
        # Every rank writes its part of the checkpoint (its rng_state_R.pth, on its own node) before
        # its on_save, and nothing in the Trainer waits for the others: wait here, so that the
        # commit covers every rank's files whole.
        _barrier(args)
        if not state.is_world_process_zero:
            return control
        tag = f"checkpoint-{state.global_step}"
        path = os.path.join(args.output_dir, tag)
        if not os.path.isdir(path):
            raise _lib.SluiceError(2, f"the Trainer's checkpoint {path} is not there to commit")
        if _lib.should_commit(self.commit):
            expected = os.path.realpath(_lib.ckpt_dir(None))
            if os.path.realpath(args.output_dir) != expected:
                raise _lib.SluiceError(
                    22,
                    f"cannot commit {tag}: the Trainer's output_dir {args.output_dir} is not "
                    f"$SLUICE_CKPT_DIR ({expected}); set TrainingArguments(output_dir="
                    'os.environ["SLUICE_CKPT_DIR"])',
                )
            _lib.commit(tag, self.sluice)
        return control
