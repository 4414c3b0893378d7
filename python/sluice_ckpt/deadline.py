"""The job's time limit, for a final save that beats it without signals (issue 27).

A job killed at its time limit loses everything since its last periodic save, and the signal a
trainer could catch to save once more is fragile (torchrun swallows it; a handler that dies mid-save
leaves nothing). Slurm knows when the job will end: `time_left()` asks it (`squeue -o %e` for
$SLURM_JOB_ID, again at most once a minute, so a time limit an admin extends is seen), and
`should_save()` compares what is left with what this process's recent saves took — every
sluice_ckpt save (`save()`, `SluiceWriter`, synchronous or not) records how long it took from its
start to its commit.

    for step in range(start, steps):
        train_step()
        final = sluice_ckpt.should_save(margin=120)
        if step % 1000 == 0 or final:
            dcp.save(state, storage_writer=sluice_ckpt.SluiceWriter(f"step-{step}"))
        if final:
            break  # the job ends here, its last checkpoint committed

`margin` is what the agent needs after the commit: its flush from the RAM tier and the archive, which
the job's epilog waits for (`ckpt.epilog_wait` on the node).
"""

import collections
import os
import subprocess
import sys
import threading
import time

#: How long this process's recent saves took, start to commit (seconds), newest last.
_durations = collections.deque(maxlen=8)
_lock = threading.Lock()
_end = {"at": None, "asked": None}
_said = []

#: How long an answer of squeue is used before it is asked again (seconds).
REFRESH = 60.0


def record_save(seconds):
    """Notes that a save took `seconds` (sluice_ckpt's own saves call it)."""
    with _lock:
        _durations.append(float(seconds))


def save_cost():
    """The longest of this process's recent saves (seconds; 0 before the first)."""
    with _lock:
        return max(_durations, default=0.0)


def _ask_slurm(job_id):
    """The job's end time (epoch seconds) as squeue gives it, or None (no limit, or no answer)."""
    squeue = os.environ.get("SLUICE_SQUEUE", "squeue")
    try:
        out = subprocess.run(
            [squeue, "--noheader", "--jobs", job_id, "--format", "%e"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (OSError, subprocess.SubprocessError, ValueError, OverflowError):
        return None  # "Unknown", "NONE" (no time limit), or squeue unreachable


def end_time():
    """When the job's time limit ends it (epoch seconds), or None: outside a Slurm job, without a
    time limit, or where squeue does not answer. $SLUICE_JOB_END_TIME (epoch seconds) overrides."""
    given = os.environ.get("SLUICE_JOB_END_TIME")
    if given:
        return float(given)
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    with _lock:
        now = time.monotonic()
        if _end["asked"] is None or now - _end["asked"] >= REFRESH:
            _end["at"], _end["asked"] = _ask_slurm(job_id), now
        return _end["at"]


def time_left():
    """Seconds until the job's time limit (negative once it passed), or None when it has none."""
    end = end_time()
    return None if end is None else end - time.time()


def should_save_everywhere(margin=60.0):
    """should_save() as rank 0 of torch.distributed sees it, on every rank (a save is collective:
    ranks that disagreed would wait for each other for ever); should_save() without a process
    group."""
    due = should_save(margin)
    try:
        import torch.distributed as dist
    except ImportError:
        return due
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [due]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])
    return due


def should_save(margin=60.0):
    """True when the job's time limit is closer than the cost of one more save (the longest of
    this process's recent saves) plus `margin` seconds: save now, and stop. False without a
    time limit. Says so on stderr the first time, for the job's output."""
    left = time_left()
    if left is None:
        return False
    cost = save_cost()
    due = left <= cost + margin
    if due and not _said:
        _said.append(left)
        print(
            f"sluice_ckpt: {max(left, 0):.0f} s left before job {os.environ.get('SLURM_JOB_ID', '?')}'s "
            f"time limit; one save takes up to {cost:.1f} s, and {margin:.0f} s are kept for the "
            "agent's archive: save now",
            file=sys.stderr,
            flush=True,
        )
    return due
