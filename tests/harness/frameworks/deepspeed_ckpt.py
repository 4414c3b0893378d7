"""DeepSpeed's checkpoint of a ZeRO stage 1 run on three ranks, one per node:
$SLUICE_CKPT_DIR/latest (the tag, written last by rank 0: DeepSpeed's completion signal, the only
commit) and $SLUICE_CKPT_DIR/global_step10/ with mp_rank_00_model_states.pt (rank 0) and
zero_pp_rank_R_mp_rank_00_optim_states.pt, each written by rank R on its own node.

`python deepspeed_ckpt.py PHASE WORK PORT real` uses the real `deepspeed` package (CPU accelerator,
gloo): `save` trains ten steps and calls engine.save_checkpoint; `load` builds a fresh engine (other
seed) and calls engine.load_checkpoint on the directory (no tag: the restored `latest` names it) on every rank.

`... stand-in` is for machines where `deepspeed` does not install: the same files written by this
script with torch.save, in the same places and with the same kind of content (the module's state dict
and DeepSpeed's bookkeeping in the model states file; each rank's partition of the flat fp32 master
weights and Adam state in its ZeRO file), read back with torch.load.

Either way every rank then torch.load's every file of the checkpoint and compares it with what its
writer saved, and compares the state it loaded tensor by tensor. See fwcheck.py.
"""

import os

import torch
import torch.distributed as dist

import fwcheck

TAG = "global_step10"
STEPS = 10


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def files(r):
    """The files of the checkpoint, and those this rank writes."""
    zero = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(r.world)]
    mine = [zero[r.rank]] + (["mp_rank_00_model_states.pt"] if r.rank == 0 else [])
    return ["mp_rank_00_model_states.pt", *zero], mine


# ---------------------------------------------------------------------------- the real package


def engine(r, seed):
    import deepspeed

    m = model(seed)
    config = {
        "train_batch_size": r.world,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1000,
    }
    eng, _, _, _ = deepspeed.initialize(
        model=m, model_parameters=m.parameters(), config=config, dist_init_required=False
    )
    return eng


def engine_state(eng):
    return {"module": eng.module.state_dict(), "optimizer": eng.optimizer.state_dict()}


def save_real(r):
    r.init_gloo()
    eng = engine(r, seed=0)
    torch.manual_seed(100 + r.rank)
    for _ in range(STEPS):
        eng.backward(eng(torch.randn(1, 32)).pow(2).sum())
        eng.step()
    eng.save_checkpoint(r.ckpt)  # tag global_step{N}; rank 0 writes `latest` last
    r.expect(f"engine-rank{r.rank}", engine_state(eng))
    r.expect_files(TAG, files(r)[1])
    r.record_files(TAG)


def load_real(r):
    tag = r.restored_tag()
    r.init_gloo()
    eng = engine(r, seed=1)
    r.must_differ(f"engine-rank{r.rank}", engine_state(eng))
    # Without a tag, as a training script resuming "the latest checkpoint" does: sluice restores
    # DeepSpeed's `latest` beside the checkpoint.
    path, _ = eng.load_checkpoint(r.ckpt)
    if path is None or os.path.basename(os.path.dirname(path)) != tag:
        raise fwcheck.Failure(f"engine.load_checkpoint({r.ckpt}) loaded {path}, not {tag}")
    r.check(f"engine-rank{r.rank}", engine_state(eng))
    r.check_files(tag, files(r)[0])
    r.record_files(tag)


# ------------------------------------------------------------------------------- the stand-in


def stand_in_state(r, seed):
    """What the two kinds of file hold: the model states (rank 0) and this rank's ZeRO partition."""
    m = model(seed)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    torch.manual_seed(100 + seed)
    for _ in range(STEPS):
        m(torch.randn(1, 32)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    part = flat.chunk(r.world)[r.rank].clone()
    model_states = {
        "module": m.state_dict(),
        "buffer_names": [],
        "optimizer": None,
        "lr_scheduler": None,
        "global_steps": STEPS,
        "global_samples": STEPS * r.world,
        "skipped_steps": 0,
        "dp_world_size": r.world,
        "mp_world_size": 1,
        "ds_config": {"train_batch_size": r.world, "zero_optimization": {"stage": 1}},
        "ds_version": "stand-in",
    }
    zero = {
        "optimizer_state_dict": {
            "zero_stage": 1,
            "partition_count": [r.world],
            "single_partition_of_fp32_groups": [part],
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(float(STEPS)), "exp_avg": part * 0.1, "exp_avg_sq": part * part}},
                "param_groups": [{"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0]}],
            },
        },
        "ds_config": model_states["ds_config"],
        "ds_version": "stand-in",
    }
    return model_states, zero


def save_stand_in(r):
    r.init_gloo()
    model_states, zero = stand_in_state(r, seed=0)
    d = os.path.join(r.ckpt, TAG)
    os.makedirs(d)
    torch.save(zero, os.path.join(d, files(r)[1][0]))
    if r.rank == 0:
        torch.save(model_states, os.path.join(d, "mp_rank_00_model_states.pt"))
    r.expect(f"stand-in-rank{r.rank}", {"model_states": model_states, "zero": zero})
    r.expect_files(TAG, files(r)[1])
    r.record_files(TAG)
    dist.barrier()  # every rank's files are written: now rank 0 names the tag in `latest`
    if r.rank == 0:
        with open(os.path.join(r.ckpt, "latest"), "w") as f:
            f.write(TAG)


def load_stand_in(r):
    tag = r.restored_tag()
    r.init_gloo()
    d = os.path.join(r.ckpt, tag)
    model_states = fwcheck.load_pt(os.path.join(d, "mp_rank_00_model_states.pt"))
    zero = fwcheck.load_pt(os.path.join(d, files(r)[1][0]))
    m = model(seed=1)
    r.must_differ(f"stand-in-rank{r.rank}", {"model_states": {"module": m.state_dict()}})
    m.load_state_dict(model_states["module"])
    model_states["module"] = m.state_dict()
    r.check(f"stand-in-rank{r.rank}", {"model_states": model_states, "zero": zero})
    r.check_files(tag, files(r)[0])
    r.record_files(tag)


def save(r):
    (save_real if r.args[-1] == "real" else save_stand_in)(r)


def load(r):
    (load_real if r.args[-1] == "real" else load_stand_in)(r)


if __name__ == "__main__":
    fwcheck.run(save, load)
