"""What a job script tells the driver that watches it (an end-to-end test, a bench case):

- `Report`: a JSON report in the driver's work directory, WORK/report.json, replaced whole on every
  write (temp file, then rename), so the driver, which polls it, never reads half of one;
- `fs_type`: the type of the file system a path is on, from the job's own mount table (what tells
  the RAM tier's tmpfs from the hot tier).

The driver copies this file beside the job script, which imports it: Python puts the script's
directory first on sys.path. Used by tests/tests/ram_tier.rs, bench/py/commit_job.py and
bench/py/replicas_job.py.
"""

import json
import os


class Report(dict):
    """The report's fields so far; `errors` is a list the script appends to."""

    def __init__(self, work, **fields):
        super().__init__(fields, errors=[])
        self.path = os.path.join(work, "report.json")

    def put(self, name, value):
        """Sets `name` to `value` and writes the report."""
        self[name] = value
        self.write()

    def write(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self, f)
        os.replace(self.path + ".tmp", self.path)


def fs_type(path):
    """The type of the file system `path` is on: that of the longest mount point it starts with."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    best = max((m for m in mounts if path.startswith(m[4])), key=lambda m: len(m[4]))
    return best[best.index("-") + 1]
