"""Megatron-LM's (legacy, non-distributed) checkpoint layout of a tensor-parallel run, TP=3, one rank
per node: rank R writes $SLUICE_CKPT_DIR/iter_0000200/mp_rank_0R/model_optim_rng.pt (torch.save of
its shard of the bf16 model, the fp32 Adam state, the iteration, the args namespace and the RNG
states), then rank 0 writes `latest_checkpointed_iteration.txt` holding `200`: Megatron's completion
signal, the only commit.

A stand-in: Megatron-LM's trainer, which writes this layout, is not installed here; the layout and
the kind of content are Megatron's, written by this script with torch.save. `load` builds a fresh shard (other seed)
on every rank, torch.load's its own mp_rank file into it as Megatron's loader does, compares tensor
by tensor, and then torch.load's every rank's file and compares it with what its writer saved.
See fwcheck.py.
"""

import argparse
import os
import random

import torch
import torch.distributed as dist

import fwcheck

ITERATION = 200
TAG = f"iter_{ITERATION:07d}"
HIDDEN, VOCAB = 32, 96


def shard(r, seed):
    """This rank's slice of a tiny GPT: vocab-parallel embedding, column-parallel QKV, row-parallel
    output projection; bf16 weights with an fp32 Adam (its master copy)."""
    torch.manual_seed(seed * 10 + r.rank)
    n = r.world
    model = torch.nn.ModuleDict(
        {
            "embedding": torch.nn.Embedding(VOCAB // n, HIDDEN),
            "qkv": torch.nn.Linear(HIDDEN, 3 * HIDDEN // n),
            "dense": torch.nn.Linear(3 * HIDDEN // n, HIDDEN, bias=False),
        }
    ).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    return model, master, torch.optim.Adam(master, lr=1e-3)


def names(r):
    return [f"mp_rank_{i:02d}/model_optim_rng.pt" for i in range(r.world)]


def save(r):
    r.init_gloo()
    model, master, opt = shard(r, seed=0)
    for _ in range(3):
        sum(p.pow(2).sum() for p in master).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        for p, m in zip(model.parameters(), master):
            p.copy_(m)
    random.seed(ITERATION + r.rank)
    state = {
        "args": argparse.Namespace(
            tensor_model_parallel_size=r.world, pipeline_model_parallel_size=1, hidden_size=HIDDEN, bf16=True
        ),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": {"language_model": model.state_dict()},
        "optimizer": {"optimizer": opt.state_dict(), "fp32_from_fp16_params": [[m.detach() for m in master]]},
        "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": ITERATION},
        "rng_state": [{"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}],
        "num_floating_point_operations_so_far": 0,
    }
    path = os.path.join(r.ckpt, TAG, names(r)[r.rank])
    os.makedirs(os.path.dirname(path))
    torch.save(state, path)
    r.expect(f"rank{r.rank}", {"model": model.state_dict(), "optim": opt.state_dict()})
    r.expect_files(TAG, [names(r)[r.rank]])
    r.record_files(TAG)
    dist.barrier()  # every rank's shard is on disk: now rank 0 writes the tracker file
    if r.rank == 0:
        with open(os.path.join(r.ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def load(r):
    tag = r.restored_tag()
    r.init_gloo()
    model, master, opt = shard(r, seed=1)
    r.must_differ(f"rank{r.rank}", {"model": model.state_dict()})
    # Megatron's --load of the directory reads the iteration from its signal file, which sluice
    # restores beside the checkpoint.
    with open(os.path.join(r.ckpt, "latest_checkpointed_iteration.txt")) as f:
        found = "iter_%07d" % int(f.read().strip())
    if found != tag:
        raise fwcheck.Failure(f"latest_checkpointed_iteration.txt names {found}, not {tag}")
    state = fwcheck.load_pt(os.path.join(r.ckpt, tag, names(r)[r.rank]))
    if state["iteration"] != ITERATION:
        raise fwcheck.Failure(f"iteration {state['iteration']} in {tag}")
    model.load_state_dict(state["model"]["language_model"])
    opt.load_state_dict(state["optimizer"]["optimizer"])
    r.check(f"rank{r.rank}", {"model": model.state_dict(), "optim": opt.state_dict()})
    r.check_files(tag, names(r))
    r.record_files(tag)


if __name__ == "__main__":
    fwcheck.run(save, load)
