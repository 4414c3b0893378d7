"""torch.distributed.checkpoint (DCP) on every rank, as FSDP-style training saves: the model's
parameters and Adam's state are DTensors sharded across the ranks (dim 0), a bf16 buffer is
replicated. `save` trains three steps and calls dcp.save into $SLUICE_CKPT_DIR/dcp-1: each rank
writes its own shard file, and the coordinator (rank 0) writes `.metadata` last: DCP's completion
signal, the only commit. `load` builds a fresh model (other seed), dcp.load's the restored tag into it
on every rank and compares every local shard with what that rank saved. See fwcheck.py.

With the argument `sluice`, the save goes through sluice_ckpt.SluiceWriter (whose finish on rank 0
runs `sluice ckpt commit`) and the load through sluice_ckpt.SluiceReader, instead of DCP's own
FileSystemWriter and FileSystemReader.
"""

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fwcheck

TAG = "dcp-1"


def build(r, seed):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (r.world,))
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.ReLU(), torch.nn.Linear(96, 12))
    for layer in model:
        for name, p in list(layer.named_parameters()):
            setattr(layer, name, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
    model.register_buffer("ema_bf16", torch.randn(64, dtype=torch.bfloat16))
    return mesh, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def save(r):
    r.init_gloo()
    mesh, model, opt = build(r, seed=0)
    for _ in range(3):
        x = distribute_tensor(torch.randn(8, 48), mesh, [Replicate()])
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    s = state(model, opt)
    r.expect(f"{TAG}-rank{r.rank}", s)
    if "sluice" in r.args:
        import sluice_ckpt

        writer = sluice_ckpt.SluiceWriter(TAG)
        dcp.save(s, storage_writer=writer)
        if r.rank == 0:
            r.note(f"sluice ckpt commit: {writer.commit_output}")
    else:
        dcp.save(s, checkpoint_id=os.path.join(r.ckpt, TAG))
    r.record_files(TAG)


def load(r):
    tag = r.restored_tag()
    r.init_gloo()
    _, model, opt = build(r, seed=1)
    # Adam's state exists only after a step; a step on zero gradients creates it without moving
    # the parameters, so dcp.load has every tensor of the saved state to fill in place.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    s = state(model, opt)
    r.must_differ(f"{TAG}-rank{r.rank}", s)
    if "sluice" in r.args:
        import sluice_ckpt

        dcp.load(s, storage_reader=sluice_ckpt.SluiceReader(tag))
    else:
        dcp.load(s, checkpoint_id=os.path.join(r.ckpt, tag))
    # What the model and the optimizer now hold, read afresh (dcp.load fills their tensors in place).
    r.check(f"{TAG}-rank{r.rank}", state(model, opt))
    r.record_files(tag)


if __name__ == "__main__":
    fwcheck.run(save, load)
