"""What the framework jobs of tests/tests/frameworks.rs share: one rank of a multi-node job (one task
per node), torch.distributed over gloo, and how a restored checkpoint is checked.

A job step runs `python SCRIPT PHASE WORK PORT [ARG...]` on every node: PHASE is `save` or `load`,
WORK the test's work directory (one file system for all virtual nodes), PORT a free port for the gloo
rendezvous on 127.0.0.1.

The `save` ranks record what they saved under WORK/expected/: the values of every tensor of their
state (torch.save of the flattened state), and per checkpoint file they wrote what torch.load reads
from it. The `load` ranks load the restored checkpoint with the framework's own loader and compare
tensor by tensor (dtype, shape and every value).

Each rank leaves WORK/out/PHASE/NODE.json for the test: its rank and node, SLUICE_RESTORED_TAG, the
entries of $SLUICE_CKPT_DIR, the checkpoint files it wrote or found (path -> sha256), how many
tensors it compared, what it noticed, and every mismatch. A failure also exits 1 with its reason on
stderr (the job's output).
"""

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist


class Rank:
    """One task of the job: its place in it, its checkpoint directory, and its report."""

    def __init__(self):
        self.phase, self.work, self.port = sys.argv[1], sys.argv[2], int(sys.argv[3])
        self.args = sys.argv[4:]
        self.rank = int(os.environ["SLURM_PROCID"])
        self.world = int(os.environ["SLURM_NTASKS"])
        self.node = os.environ["SLURMD_NODENAME"]
        self.ckpt = os.environ["SLUICE_CKPT_DIR"]
        self.report = {
            "rank": self.rank,
            "node": self.node,
            "phase": self.phase,
            "restored_tag": os.environ.get("SLUICE_RESTORED_TAG"),
            "ckpt_dir_entries": sorted(os.listdir(self.ckpt)),
            "files": {},
            "compared": 0,
            "notes": [],
            "errors": [],
        }
        # What torch.distributed's env:// rendezvous and DeepSpeed read; the process group itself
        # is set up with an explicit tcp:// init_method (init_gloo).
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
        )
        torch.set_num_threads(1)

    def init_gloo(self):
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{self.port}",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=120),
        )

    def restored_tag(self):
        """SLUICE_RESTORED_TAG, which a load job must have."""
        tag = self.report["restored_tag"]
        if not tag:
            raise Failure(f"SLUICE_RESTORED_TAG is not set; $SLUICE_CKPT_DIR holds {self.report['ckpt_dir_entries']}")
        return tag

    def note(self, text):
        self.report["notes"].append(text)

    # ------------------------------------------------------------------ what was saved

    def expect(self, name, state):
        """Records the values of `state` (nested dicts, lists, tensors, ...) as `name`."""
        path = os.path.join(self.work, "expected", f"{name}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(flatten(state), path + ".tmp")
        os.replace(path + ".tmp", path)

    def expected(self, name):
        path = os.path.join(self.work, "expected", f"{name}.pt")
        if not os.path.exists(path):
            raise Failure(f"the save job recorded no {name} ({path})")
        return torch.load(path, map_location="cpu", weights_only=False)

    def expect_files(self, tag, names):
        """Records what torch.load reads from each of `names` (files of TAG this rank wrote)."""
        for rel in names:
            self.expect(file_ref(tag, rel), load_pt(os.path.join(self.ckpt, tag, rel)))

    def record_files(self, tag):
        """path -> sha256 of every file below $SLUICE_CKPT_DIR/TAG on this node, for the report."""
        root = os.path.join(self.ckpt, tag)
        files = {}
        for d, _, names in os.walk(root):
            for n in names:
                p = os.path.join(d, n)
                with open(p, "rb") as f:
                    files[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
        self.report["files"] = dict(sorted(files.items()))
        return files

    # ------------------------------------------------------------------ what was loaded

    def must_differ(self, name, state):
        """Before loading: the fresh `state` (or the part of it given) must differ from the saved one
        somewhere, or comparing after the load proves nothing."""
        want, got = self.expected(name), flatten(state)
        common = [k for k, v in want.items() if torch.is_tensor(v) and torch.is_tensor(got.get(k))]
        if not common:
            raise Failure(f"{name}: the fresh state has none of the saved tensors: {sorted(got)[:5]}")
        if all(same_tensor(want[k], got[k]) for k in common):
            raise Failure(f"{name}: the fresh state already equals the saved one; the test would prove nothing")

    def check(self, name, state):
        """Compares `state` with what the save job recorded as `name`, tensor by tensor."""
        want, got = self.expected(name), flatten(state)
        errors = []
        for k in sorted(set(want) - set(got)):
            errors.append(f"{name}: {k} is missing")
        for k in sorted(set(got) - set(want)):
            errors.append(f"{name}: {k} was not saved")
        for k in sorted(set(want) & set(got)):
            w, g = want[k], got[k]
            if torch.is_tensor(w):
                self.report["compared"] += 1
                if not torch.is_tensor(g):
                    errors.append(f"{name}: {k} is {type(g).__name__}, saved a tensor")
                elif (w.dtype, tuple(w.shape)) != (g.dtype, tuple(g.shape)):
                    errors.append(f"{name}: {k} is {g.dtype}{tuple(g.shape)}, saved {w.dtype}{tuple(w.shape)}")
                elif not same_tensor(w, g):
                    n = int((w != g).sum())
                    errors.append(f"{name}: {k} ({w.dtype}{tuple(w.shape)}) differs in {n} elements")
            elif w != g:
                errors.append(f"{name}: {k} is {g!r}, saved {w!r}")
        self.report["errors"] += errors[:20]
        if errors:
            raise Failure(f"{len(errors)} mismatches against what was saved: {errors[:5]}")

    def check_files(self, tag, names):
        """torch.load of each of `names` in the restored TAG, compared with what its writer recorded."""
        for rel in names:
            self.check(file_ref(tag, rel), load_pt(os.path.join(self.ckpt, tag, rel)))

    # ------------------------------------------------------------------ the rest

    def cli(self, *args):
        """The sluice CLI (its path is the first extra argument), as a user runs it in the job."""
        p = subprocess.run([self.args[0], *args], capture_output=True, text=True, timeout=120)
        said = (p.stdout + p.stderr).strip()
        self.note(f"sluice {' '.join(args)}: exit {p.returncode}: {said}")
        if p.returncode != 0:
            raise Failure(f"sluice {' '.join(args)} exited {p.returncode}: {said}")
        return said

    def write_report(self):
        path = os.path.join(self.work, "out", self.phase, f"{self.node}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(self.report, f, indent=1)
        os.replace(path + ".tmp", path)


class Failure(Exception):
    """A check failed; the message says what the user would have seen wrong."""


def run(save, load):
    """Runs this rank's phase; always writes the report; exits 1 with the reason on a failure."""
    r = Rank()
    code = 0
    try:
        {"save": save, "load": load}[r.phase](r)
    except Exception as e:  # every failure must reach the report and the job output
        code = 1
        r.report["errors"].append(f"{type(e).__name__}: {e}")
        print(f"rank {r.rank} on {r.node} ({r.phase}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if not isinstance(e, Failure):
            traceback.print_exc()
    finally:
        r.write_report()
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    # Leave without running the C++ libraries' exit-time destructors: gloo's can abort a rank whose
    # work is done and reported ("terminate called without an active exception", seen once in CI
    # with torch 2.15 after every rank had written its report), failing a job sluice served well.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def flatten(obj, key=""):
    """`a/b/0`-style key -> leaf of a nested state: plain tensors (a DTensor as its local shard),
    numbers, strings; objects (argparse.Namespace, loss scalers) by their attributes."""

    def sub(k):
        return f"{key}/{k}" if key else str(k)

    out = {}
    if hasattr(obj, "to_local") and torch.is_tensor(obj):
        obj = obj.to_local()
    if torch.is_tensor(obj):
        out[key] = obj.detach().cpu().clone()
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            out.update(flatten(obj[k], sub(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten(v, sub(i)))
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        out[key] = obj
    elif isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        out[key] = str(obj)
    elif isinstance(obj, argparse.Namespace) or hasattr(obj, "__dict__"):
        out.update(flatten(vars(obj), sub(f"<{type(obj).__name__}>")))
    else:
        out[key] = repr(obj)
    return out


def same_tensor(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def file_ref(tag, rel):
    return f"file-{tag}-{rel.replace('/', '--')}"


def load_pt(path):
    """torch.load as the frameworks call it for their own checkpoints (full unpickling: DeepSpeed and
    Megatron store config objects next to the tensors)."""
    return torch.load(path, map_location="cpu", weights_only=False)
