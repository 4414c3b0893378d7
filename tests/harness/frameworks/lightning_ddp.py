"""PyTorch Lightning DDP across the job's nodes, adopted in one line (issue 27): every rank is an
`srun` task (Lightning's own SLURMEnvironment finds its rank, node and world in Slurm's variables),
gloo on CPU, and `Trainer(plugins=[SluiceCheckpointIO()])` with a ModelCheckpoint in
$SLUICE_CKPT_DIR.

save: an uninterrupted run of 12 steps from seed 0; the ModelCheckpoint every 8 steps makes rank 0
alone write step-8/step-8.ckpt through the sluice writer (asynchronously) and commit it, so the
job's other nodes never have the tag. Rank 0 records the weights and SGD momentum after step 12
(`final`) and what step-8.ckpt holds.

load: `--ckpt-restore=latest` put step-8 on every node. Each rank builds the model from another
seed, resumes with `trainer.fit(..., ckpt_path=restored_checkpoint())` and must end at step 12
with exactly the weights and momentum of the uninterrupted run. See fwcheck.py.
"""

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import fwcheck
from sluice_ckpt.lightning import SluiceCheckpointIO, restored_checkpoint

TAG = "step-8"
STEPS = 12


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(r, seed, ckpt_path=None):
    # 64 samples, 32 per rank (two nodes), batches of 8: an epoch is 4 steps, and step 8 ends one.
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)),
        batch_size=8,
    )
    torch.manual_seed(seed)
    model = Model()
    every = ModelCheckpoint(dirpath=r.ckpt, filename="step-{step}", auto_insert_metric_name=False,
                            every_n_train_steps=8, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, num_nodes=r.world, strategy="ddp",
        plugins=[SluiceCheckpointIO()], callbacks=[every],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    if ckpt_path is not None:
        r.must_differ("final", {"model": model.state_dict()})
    trainer.fit(model, data, ckpt_path=ckpt_path)
    if trainer.global_step != STEPS:
        raise fwcheck.Failure(f"the run ended at step {trainer.global_step}, not {STEPS}")
    momentum = {k: v["momentum_buffer"] for k, v in trainer.optimizers[0].state_dict()["state"].items()}
    return {"model": model.state_dict(), "momentum": momentum}


def save(r):
    final = fit(r, seed=0)
    if r.rank == 0:
        r.expect("final", final)
        r.expect_files(TAG, [f"{TAG}.ckpt"])
        r.record_files(TAG)
    elif os.path.exists(os.path.join(r.ckpt, TAG)):
        raise fwcheck.Failure(f"rank {r.rank} has {TAG} on its node: only rank 0 saves")


def load(r):
    tag = r.restored_tag()
    path = restored_checkpoint()
    if path != os.path.join(r.ckpt, tag, f"{tag}.ckpt"):
        raise fwcheck.Failure(f"restored_checkpoint() is {path}")
    r.check_files(tag, [f"{tag}.ckpt"])
    r.check("final", fit(r, seed=1, ckpt_path=path))
    r.record_files(tag)


if __name__ == "__main__":
    fwcheck.run(save, load)
