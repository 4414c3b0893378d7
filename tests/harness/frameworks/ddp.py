"""The common DDP pattern: every rank trains a DistributedDataParallel model (gloo all-reduces the
gradients), and rank 0 alone saves (`if rank == 0: torch.save(...)`) into
$SLUICE_CKPT_DIR/step-1/model.pt and commits it with `sluice ckpt commit step-1`: the job's other
nodes never have the tag at all. `load` builds a fresh DDP model (other seed) on every rank, and each
rank torch.load's the restored file itself, loads it into the model and the optimizer and compares
tensor by tensor with what rank 0 saved. See fwcheck.py.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fwcheck

TAG = "step-1"


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters to every rank
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)


def state(ddp, opt, step):
    return {"model": ddp.module.state_dict(), "optim": opt.state_dict(), "step": step}


def save(r):
    r.init_gloo()
    ddp, opt = build(seed=0)
    torch.manual_seed(100 + r.rank)  # each rank its own batches
    for _ in range(3):
        ddp(torch.randn(4, 32)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    if r.rank == 0:
        s = state(ddp, opt, 3)
        path = os.path.join(r.ckpt, TAG, "model.pt")
        os.makedirs(os.path.dirname(path))
        torch.save(s, path)
        r.expect(TAG, s)
        r.expect_files(TAG, ["model.pt"])
        r.record_files(TAG)
        r.cli("ckpt", "commit", TAG)
    dist.barrier()


def load(r):
    tag = r.restored_tag()
    r.init_gloo()
    ddp, opt = build(seed=1)
    r.must_differ(TAG, state(ddp, opt, 0))
    # After DDP's constructor: each rank's model holds what this rank loaded, not rank 0's broadcast.
    saved = torch.load(os.path.join(r.ckpt, tag, "model.pt"), map_location="cpu")
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    r.check(TAG, state(ddp, opt, saved["step"]))
    r.check_files(tag, ["model.pt"])
    r.record_files(tag)


if __name__ == "__main__":
    fwcheck.run(save, load)
