"""The Hugging Face Trainer across the job's nodes, adopted in one line (issue 27): every rank is an
`srun` task with torch.distributed's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, as fwcheck sets
them), which Accelerate reads to run the Trainer data-parallel over gloo on CPU, with
`output_dir=$SLUICE_CKPT_DIR` and `callbacks=[SluiceCallback()]`. The model is a tiny BERT built
from its config (no download), with dropout, so a resume repeats the uninterrupted run only if every
rank gets its own random state back.

save: an uninterrupted run of 12 steps from seed 0, saving every 8 steps (and at the end):
checkpoint-8/ holds the model, optimizer, scheduler and trainer state from rank 0 and
rng_state_R.pth from every rank R, each on its own node; SluiceCallback commits it once every rank
has written its part. Rank 0 records the weights and AdamW's state after step 12 (`final`).

load: `--ckpt-restore=checkpoint-8` put every rank's files on every node. Each rank builds the
model from another seed, resumes with `trainer.train(resume_from_checkpoint=restored_checkpoint())`
and must end at step 12 with exactly the weights and optimizer state of the uninterrupted run. This
run saves nothing (`save_strategy="no"`): its checkpoint-12 would differ from the archived one in
its job-specific paths, and the archive keeps what it has. See fwcheck.py.
"""

import os

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

import fwcheck
from sluice_ckpt.hf import SluiceCallback, restored_checkpoint

TAG = "checkpoint-8"
STEPS = 12


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 2)}


def train(r, seed, resume=None):
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=2)
    model = BertForSequenceClassification(config)
    if resume is not None:
        r.must_differ("final", {"model": model.state_dict()})
    args = TrainingArguments(
        output_dir=r.ckpt, max_steps=STEPS, save_steps=8, save_strategy="steps" if resume is None else "no",
        per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_strategy="no",
        seed=0, data_seed=0, ddp_backend="gloo", dataloader_num_workers=0,
    )
    if args.world_size != r.world or args.process_index != r.rank:
        raise fwcheck.Failure(f"the Trainer sees rank {args.process_index} of {args.world_size}, "
                              f"Slurm says {r.rank} of {r.world}")
    trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[SluiceCallback()])
    trainer.train(resume_from_checkpoint=resume)
    if trainer.state.global_step != STEPS:
        raise fwcheck.Failure(f"the run ended at step {trainer.state.global_step}, not {STEPS}")
    return {"model": model.state_dict(), "optim": trainer.optimizer.state_dict()["state"]}


def save(r):
    final = train(r, seed=0)
    mine = [f"rng_state_{r.rank}.pth"]
    if r.rank == 0:
        r.expect("final", final)
        mine += ["optimizer.pt", "scheduler.pt"]
    r.expect_files(TAG, mine)
    r.record_files(TAG)


def load(r):
    tag = r.restored_tag()
    path = restored_checkpoint()
    if path != os.path.join(r.ckpt, tag):
        raise fwcheck.Failure(f"restored_checkpoint() is {path}")
    files = [f"rng_state_{k}.pth" for k in range(r.world)] + ["optimizer.pt", "scheduler.pt"]
    r.check_files(tag, files)
    r.check("final", train(r, seed=1, resume=path))
    r.record_files(tag)


if __name__ == "__main__":
    fwcheck.run(save, load)
