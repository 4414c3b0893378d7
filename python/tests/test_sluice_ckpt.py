"""sluice_ckpt with real PyTorch (the harness's venv, /opt/sluice-test/torch-venv), on this machine:

    $SLUICE_TORCH_VENV/bin/python -m unittest discover -s python/tests -v

(tests/run-all.sh runs it after `cargo test --workspace`, which built libsluice_writer.so in
target/debug.) Checks what a training script sees: dcp.save and dcp.async_save through
SluiceWriter, loaded back tensor-equal by dcp.load through SluiceReader; save()/load(); the tag
committed through the `sluice` CLI exactly when the save completed (a stand-in CLI that records
its arguments: there is no agent here — the end-to-end test tests/tests/writer.rs commits for
real); a failed commit reaching the caller; files byte-identical whatever the sizes; the cuFile
probe answering "unavailable" in under a second; and `pip install ./python` giving a package that
finds its bundled library.
"""

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)
sys.path.insert(0, PKG_ROOT)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import sluice_ckpt  # noqa: E402


def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(257, 129, generator=g),  # fp32, not a multiple of 4 KiB
            "b": torch.randn(129, generator=g).to(torch.bfloat16),
            "big": torch.randn(1 << 20, generator=g),  # 4 MiB: several writer blocks
        },
        "optim": {"step": torch.tensor(7), "lr": 0.01},
        "epoch": 3,
    }


def zeros_like(s):
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "optim": {"step": torch.tensor(0), "lr": 0.0},
        "epoch": 0,
    }


class Base(unittest.TestCase):
    def setUp(self):
        # Not /tmp alone: a disk directory, where O_DIRECT is taken (tmpfs is tested below).
        self.dir = tempfile.mkdtemp(prefix="sluice-ckpt-test-", dir=os.environ.get("SLUICE_TEST_TMP"))
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.log = os.path.join(self.dir, "commits.log")
        self.cli = os.path.join(self.dir, "sluice")
        with open(self.cli, "w") as f:
            # `ckpt list --json` answers $AGENT_STATE for every tag it is asked about.
            f.write(
                "#!/bin/sh\n"
                f'echo "$@" >> {self.log}\n'
                'if [ "$2" = list ]; then echo "{\\"ckpts\\": [{\\"tag\\": \\"$LIST_TAG\\", \\"state\\": \\"$AGENT_STATE\\"}]}"; exit 0; fi\n'
                '[ -n "$FAIL_COMMIT" ] && { echo "sluice: commit refused: $FAIL_COMMIT" >&2; exit 1; }\n'
                'echo "committed $3"\n'
            )
        os.chmod(self.cli, 0o755)
        self.ckpt = os.path.join(self.dir, "ckpt")
        os.makedirs(self.ckpt)
        self.env = {
            "SLUICE_CKPT_DIR": self.ckpt,
            "SLURM_JOB_ID": "4242",
            "SLUICE_CLI": self.cli,
        }
        extra = ["FAIL_COMMIT", "AGENT_STATE", "LIST_TAG"]
        saved = {k: os.environ.get(k) for k in list(self.env) + extra}
        os.environ.update(self.env)
        for k in extra:
            os.environ.pop(k, None)

        def restore():
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        self.addCleanup(restore)

    def commits(self):
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [line.split() for line in f.read().splitlines()]

    def assertStateEqual(self, got, want):
        for k, v in want["model"].items():
            g = got["model"][k]
            self.assertEqual((g.dtype, g.shape), (v.dtype, v.shape), k)
            self.assertTrue(torch.equal(g, v), f"model/{k} differs")
        self.assertTrue(torch.equal(got["optim"]["step"], want["optim"]["step"]))
        self.assertEqual(got["optim"]["lr"], want["optim"]["lr"])
        self.assertEqual(got["epoch"], want["epoch"])


class PoisonTests(Base):
    def test_poison_asks_the_cli_for_the_jobs_checkpoint_with_the_reason(self):
        said = sluice_ckpt.poison("step-2", "loss is NaN\n at step 3")
        self.assertEqual(said, "committed step-2")  # what the stand-in CLI answers
        with open(self.log) as f:
            self.assertEqual(f.read(), "ckpt poison step-2 --reason loss is NaN at step 3\n")
        sluice_ckpt.poison("step-2", "again", url="s3://ckpt/alice/run")
        self.assertEqual(self.commits()[1], ["ckpt", "poison", "s3://ckpt/alice/run", "step-2", "--reason", "again"])

    def test_a_refused_poison_raises_with_the_clis_reason_and_bad_input_asks_nothing(self):
        os.environ["FAIL_COMMIT"] = "job 4242 belongs to another user"
        with self.assertRaises(sluice_ckpt.SluiceError) as e:
            sluice_ckpt.poison("step-2", "loss is NaN")
        self.assertIn("sluice ckpt poison step-2 exited 1", str(e.exception))
        self.assertIn("belongs to another user", str(e.exception))
        with self.assertRaises(ValueError):
            sluice_ckpt.poison("step-2", "  ")
        with self.assertRaises(ValueError):
            sluice_ckpt.poison("../x", "bad")
        self.assertEqual(len(self.commits()), 1)


class DcpTests(Base):
    def test_dcp_save_through_sluice_writer_loads_tensor_equal_and_commits_the_tag(self):
        s = state(1)
        dcp.save(s, storage_writer=sluice_ckpt.SluiceWriter("step-100"))
        tag_dir = os.path.join(self.ckpt, "step-100")
        self.assertEqual(sorted(os.listdir(tag_dir)), [".metadata", "__0_0.distcp"])
        self.assertEqual(self.commits(), [["ckpt", "commit", "step-100"]])
        out = zeros_like(s)
        dcp.load(out, storage_reader=sluice_ckpt.SluiceReader("step-100"))
        self.assertStateEqual(out, s)
        # The same bytes DCP's own FileSystemWriter writes for the same state: nothing is lost
        # or padded by the aligned writer.
        ref = os.path.join(self.dir, "ref")
        dcp.save(s, storage_writer=dcp.FileSystemWriter(ref))
        with open(os.path.join(tag_dir, "__0_0.distcp"), "rb") as a, open(
            os.path.join(ref, "__0_0.distcp"), "rb"
        ) as b:
            self.assertEqual(a.read(), b.read())

    def test_dcp_async_save_commits_when_the_background_save_completes(self):
        s = state(2)
        fut = dcp.async_save(s, storage_writer=sluice_ckpt.SluiceWriter("step-200"))
        fut.result(timeout=120)
        self.assertEqual(self.commits(), [["ckpt", "commit", "step-200"]])
        out = zeros_like(s)
        dcp.load(out, storage_reader=sluice_ckpt.SluiceReader("step-200"))
        self.assertStateEqual(out, s)

    def test_a_refused_commit_fails_the_save_with_the_clis_reason(self):
        os.environ["FAIL_COMMIT"] = "hot tier full"
        # DCP wraps what a rank raised in its CheckpointException, with the original's text.
        from torch.distributed.checkpoint.api import CheckpointException

        with self.assertRaises((sluice_ckpt.SluiceError, CheckpointException)) as e:
            dcp.save(state(3), storage_writer=sluice_ckpt.SluiceWriter("step-300"))
        self.assertIn("sluice ckpt commit step-300 exited 1", str(e.exception))
        self.assertIn("hot tier full", str(e.exception))

    def test_a_tag_the_agent_already_committed_from_the_metadata_signal_is_this_saves_commit(self):
        # The agent saw DCP's .metadata first and archived the tag (or waits for the job's other
        # nodes): it refuses the second commit as immutable, and the save still succeeds.
        os.environ.update(FAIL_COMMIT="step-310 is archived; archives are immutable", LIST_TAG="step-310")
        for agent_state in ("archived", "waiting-for-nodes"):
            os.environ["AGENT_STATE"] = agent_state
            w = sluice_ckpt.SluiceWriter("step-310")
            dcp.save(state(6), storage_writer=w)
            self.assertIn(f"already committed ({agent_state})", w.commit_output)
        # Refused (the archive holds the tag with other content): the save fails.
        os.environ["AGENT_STATE"] = "refused"
        from torch.distributed.checkpoint.api import CheckpointException

        with self.assertRaises((sluice_ckpt.SluiceError, CheckpointException)) as e:
            dcp.save(state(7), storage_writer=sluice_ckpt.SluiceWriter("step-310"))
        self.assertIn("archives are immutable", str(e.exception))

    def test_outside_a_slurm_job_nothing_is_committed(self):
        os.environ.pop("SLURM_JOB_ID")
        dcp.save(state(4), storage_writer=sluice_ckpt.SluiceWriter("step-400"))
        self.assertEqual(self.commits(), [])
        self.assertTrue(os.path.exists(os.path.join(self.ckpt, "step-400", ".metadata")))

    def test_without_sluice_ckpt_dir_the_writer_says_what_is_missing(self):
        os.environ.pop("SLUICE_CKPT_DIR")
        with self.assertRaises(sluice_ckpt.SluiceError) as e:
            sluice_ckpt.SluiceWriter("step-1")
        self.assertIn("SLUICE_CKPT_DIR is not set", str(e.exception))
        with self.assertRaises(ValueError):
            sluice_ckpt.SluiceWriter("../escape", ckpt_dir=self.ckpt)


def bump(s, by):
    """Training's step between two saves: every tensor changed in place, and the plain values."""
    for v in s["model"].values():
        v.add_(by)
    s["optim"]["step"].add_(1)
    s["optim"]["lr"] *= 0.5
    s["epoch"] += 1


def snapshot(s):
    return {
        "model": {k: v.clone() for k, v in s["model"].items()},
        "optim": {"step": s["optim"]["step"].clone(), "lr": s["optim"]["lr"]},
        "epoch": s["epoch"],
    }


class AsyncStagingTests(Base):
    """dcp.async_save through SluiceWriter and save(async_=True): one copy into buffers kept from
    save to save, the rest in the background; each save loads its own values although the buffer
    is reused (the second save's copy waits for the first's write)."""

    def setUp(self):
        super().setUp()
        self.stager = sluice_ckpt.Stager()

    def slow_writes(self, seconds):
        # Every write stream's first write sleeps: the first save is still writing from the
        # buffer when the second save's copy starts.
        real = sluice_ckpt.Writer.write

        def write(w, b):
            if not getattr(w, "_slept", False):
                w._slept = True
                time.sleep(seconds)
            return real(w, b)

        sluice_ckpt.Writer.write = write
        self.addCleanup(setattr, sluice_ckpt.Writer, "write", real)

    def test_two_dcp_async_saves_of_changed_tensors_each_load_their_own_values(self):
        self.slow_writes(0.5)
        s = state(11)
        want1 = snapshot(s)
        f1 = dcp.async_save(s, storage_writer=sluice_ckpt.SluiceWriter("step-1100", stager=self.stager))
        bump(s, 1.0)  # training goes on: the staged copy must not see it
        want2 = snapshot(s)
        f2 = dcp.async_save(s, storage_writer=sluice_ckpt.SluiceWriter("step-1200", stager=self.stager))
        bump(s, 1.0)
        f2.result(timeout=120)
        f1.result(timeout=120)
        self.assertEqual(self.stager.allocations, 1, "the second save reused the first's buffer")
        for tag, want in (("step-1100", want1), ("step-1200", want2)):
            out = zeros_like(s)
            dcp.load(out, storage_reader=sluice_ckpt.SluiceReader(tag))
            self.assertStateEqual(out, want)
        self.assertEqual(self.commits(), [["ckpt", "commit", "step-1100"], ["ckpt", "commit", "step-1200"]])

    def test_two_async_saves_of_changed_tensors_each_load_their_own_values(self):
        self.slow_writes(0.5)
        s = state(12)
        want1 = snapshot(s)
        f1 = sluice_ckpt.save(s, "step-1300", async_=True, stager=self.stager)
        bump(s, 2.0)
        want2 = snapshot(s)
        start = time.monotonic()
        f2 = sluice_ckpt.save(s, "step-1400", async_=True, stager=self.stager)
        waited = time.monotonic() - start
        bump(s, 2.0)
        self.assertEqual(f1.result(timeout=120), os.path.join(self.ckpt, "step-1300", "state.pt"))
        self.assertEqual(f2.result(timeout=120), os.path.join(self.ckpt, "step-1400", "state.pt"))
        # The second copy waited for the first's write (which sleeps 0.5 s) before reusing the buffer.
        self.assertGreater(waited, 0.2)
        self.assertEqual(self.stager.allocations, 1)
        self.assertStateEqual(sluice_ckpt.load("step-1300"), want1)
        self.assertStateEqual(sluice_ckpt.load("step-1400"), want2)
        self.assertEqual(self.commits(), [["ckpt", "commit", "step-1300"], ["ckpt", "commit", "step-1400"]])

    def test_a_failed_async_save_frees_the_buffer_and_reaches_the_caller(self):
        f1 = sluice_ckpt.save(state(13), "step-1500", async_=True, stager=self.stager, ckpt_dir="/proc/no-such")
        with self.assertRaises(OSError):
            f1.result(timeout=60)
        s = state(14)
        f2 = sluice_ckpt.save(s, "step-1600", async_=True, stager=self.stager)
        f2.result(timeout=60)
        self.assertStateEqual(sluice_ckpt.load("step-1600"), s)

    def test_a_failed_dcp_async_save_frees_the_buffer(self):
        # A write that fails inside write_data: the lease goes with async_save's thread.
        from torch.distributed.checkpoint.api import CheckpointException

        real = sluice_ckpt.Writer.write

        def write(w, b):
            raise sluice_ckpt.SluiceError(28, "no space left on the test's tier")

        sluice_ckpt.Writer.write = write
        try:
            f1 = dcp.async_save(state(15), storage_writer=sluice_ckpt.SluiceWriter("step-1700", stager=self.stager))
            with self.assertRaises((sluice_ckpt.SluiceError, CheckpointException)) as e:
                f1.result(timeout=60)
            self.assertIn("no space left", str(e.exception))
        finally:
            sluice_ckpt.Writer.write = real
        s = state(16)
        f2 = dcp.async_save(s, storage_writer=sluice_ckpt.SluiceWriter("step-1800", stager=self.stager))
        f2.result(timeout=60)
        out = zeros_like(s)
        dcp.load(out, storage_reader=sluice_ckpt.SluiceReader("step-1800"))
        self.assertStateEqual(out, s)
        self.assertEqual(self.commits(), [["ckpt", "commit", "step-1800"]])

    def test_a_state_dict_of_another_shape_gets_new_buffers(self):
        s = state(17)
        sluice_ckpt.save(s, "step-1900", async_=True, stager=self.stager).result(timeout=60)
        s["model"]["w"] = torch.randn(3, 5)
        sluice_ckpt.save(s, "step-2000", async_=True, stager=self.stager).result(timeout=60)
        self.assertEqual(self.stager.allocations, 2)
        self.assertStateEqual(sluice_ckpt.load("step-2000"), s)

    def test_the_default_stager_is_kept_across_writers(self):
        stager = sluice_ckpt.default_stager()
        s = state(18)
        dcp.async_save(s, storage_writer=sluice_ckpt.SluiceWriter("step-2100")).result(timeout=60)
        n = stager.allocations
        bump(s, 3.0)
        dcp.async_save(s, storage_writer=sluice_ckpt.SluiceWriter("step-2200")).result(timeout=60)
        self.assertEqual(stager.allocations, n)
        out = zeros_like(s)
        dcp.load(out, storage_reader=sluice_ckpt.SluiceReader("step-2200"))
        self.assertStateEqual(out, s)
        stager.close()


def tensor_ptrs(obj):
    """The data pointers of obj's tensors, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj.data_ptr()]
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in tensor_ptrs(v)]
    return []


def state_bytes(s):
    return sum(t.numel() * t.element_size() for t in s["model"].values()) + s["optim"]["step"].element_size()


class ReserveTests(Base):
    """Stager.reserve: the first save's buffers allocated in the background, before the save
    (issue 31, "no first-save stall"); the save copies into them and allocates nothing."""

    def setUp(self):
        super().setUp()
        self.stager = sluice_ckpt.Stager()
        self.addCleanup(self.stager.close)

    def hold_allocations(self):
        """Makes every buffer allocation wait until the returned Event is set."""
        import torch.distributed._state_dict_utils as utils

        real = utils._create_cpu_state_dict
        go = threading.Event()
        started = threading.Event()

        def create(*a, **kw):
            started.set()
            go.wait(60)
            return real(*a, **kw)

        utils._create_cpu_state_dict = create
        self.addCleanup(setattr, utils, "_create_cpu_state_dict", real)
        self.addCleanup(go.set)
        return go, started

    def test_the_first_save_copies_into_the_reserved_buffers(self):
        s = state(30)
        self.stager.reserve(s, wait=True)
        reserved = tensor_ptrs(self.stager._cache)
        self.assertEqual((self.stager.allocations, self.stager.kept_bytes()), (1, state_bytes(s)))
        bump(s, 1.0)  # values may change after the reserve: only shapes and dtypes were taken
        staged, lease = self.stager.stage(s)
        lease.release()
        self.assertEqual(tensor_ptrs(staged), reserved, "the save allocated buffers of its own")
        self.assertEqual(self.stager.allocations, 1)
        sluice_ckpt.save(s, "step-3000", async_=True, stager=self.stager).result(timeout=60)
        self.assertStateEqual(sluice_ckpt.load("step-3000"), s)
        self.assertEqual(self.stager.allocations, 1)

    def test_a_reserve_returns_at_once_and_a_save_before_it_finished_waits_for_it(self):
        go, started = self.hold_allocations()
        s = state(31)
        self.stager.reserve(s)  # returns while the allocation is held
        self.assertTrue(started.wait(10), "the reserve did not start allocating in the background")
        self.assertEqual(self.stager.kept_bytes(), state_bytes(s), "a reserve in progress counts")
        saved = []
        t = threading.Thread(
            target=lambda: saved.append(sluice_ckpt.save(s, "step-3100", async_=True, stager=self.stager))
        )
        t.start()
        t.join(0.5)
        self.assertTrue(t.is_alive(), "the save did not wait for the reserve it needs")
        go.set()
        t.join(60)
        saved[0].result(timeout=60)
        self.assertEqual(self.stager.allocations, 1, "the save allocated again instead of taking the reserve")
        self.assertStateEqual(sluice_ckpt.load("step-3100"), s)

    def test_a_reserve_from_a_model_reads_only_shapes_and_serves_its_state_dict(self):
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7))
        self.stager.reserve(model, wait=True)
        staged, lease = self.stager.stage(model.state_dict())
        lease.release()
        self.assertEqual(self.stager.allocations, 1)
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(staged[k], v), k)

    def test_a_save_of_another_structure_drops_the_reserve_and_keeps_one_copy(self):
        self.stager.reserve(state(32), wait=True)
        s = state(33)
        s["model"]["w"] = torch.randn(3, 5)
        sluice_ckpt.save(s, "step-3200", async_=True, stager=self.stager).result(timeout=60)
        self.assertEqual(self.stager.allocations, 2)
        self.assertEqual(self.stager.kept_bytes(), state_bytes(s), "the reserved copy was not freed")
        self.assertStateEqual(sluice_ckpt.load("step-3200"), s)

    def test_a_second_reserve_replaces_the_first_and_a_fitting_one_does_nothing(self):
        small = state(34)
        small["model"]["big"] = torch.randn(10)
        self.stager.reserve(state(35))
        self.stager.reserve(small, wait=True)
        self.assertEqual(self.stager.kept_bytes(), state_bytes(small))
        n = self.stager.allocations
        self.stager.reserve(small, wait=True)
        self.assertEqual((self.stager.allocations, self.stager.kept_bytes()), (n, state_bytes(small)))

    def test_a_failed_reserve_is_raised_when_waited_for_and_the_save_allocates_itself(self):
        import torch.distributed._state_dict_utils as utils

        real = utils._create_cpu_state_dict

        def create(*a, **kw):
            raise MemoryError("no room for the reserve")

        utils._create_cpu_state_dict = create
        try:
            with self.assertRaises(MemoryError):
                self.stager.reserve(state(36), wait=True)
            self.stager.reserve(state(36))
        finally:
            utils._create_cpu_state_dict = real
        s = state(37)
        sluice_ckpt.save(s, "step-3300", async_=True, stager=self.stager).result(timeout=60)
        self.assertEqual(self.stager.allocations, 1)
        self.assertStateEqual(sluice_ckpt.load("step-3300"), s)

    def test_a_state_above_the_cap_is_refused_before_anything_is_copied(self):
        s = state(43)
        cap = state_bytes(s) - 1
        stager = sluice_ckpt.Stager(max_bytes=cap)
        self.addCleanup(stager.close)
        with self.assertRaises(sluice_ckpt.SluiceError) as e:
            sluice_ckpt.save(s, "step-4300", async_=True, stager=stager)
        self.assertIn("above the cap of", str(e.exception))
        self.assertIn("save it synchronously", str(e.exception))
        with self.assertRaises(sluice_ckpt.SluiceError):
            stager.reserve(s)
        self.assertEqual((stager.allocations, stager.kept_bytes()), (0, 0))
        self.assertFalse(os.path.exists(os.path.join(self.ckpt, "step-4300")), "a refused save wrote")
        self.assertEqual(self.commits(), [])
        # The same state synchronously, and asynchronously under a cap that fits it.
        sluice_ckpt.save(s, "step-4300")
        roomy = sluice_ckpt.Stager(max_bytes=state_bytes(s))
        self.addCleanup(roomy.close)
        sluice_ckpt.save(s, "step-4301", async_=True, stager=roomy).result(timeout=60)
        self.assertStateEqual(sluice_ckpt.load("step-4301"), s)

    def test_the_cap_comes_from_the_environment(self):
        from sluice_ckpt.staging import parse_size

        self.assertEqual(
            [parse_size(t) for t in ("1024", "64GiB", "64G", "512 MiB", "1.5k")],
            [1024, 64 << 30, 64 << 30, 512 << 20, 1536],
        )
        os.environ["SLUICE_CKPT_MAX_KEPT"] = "1MiB"
        self.addCleanup(os.environ.pop, "SLUICE_CKPT_MAX_KEPT", None)
        self.assertEqual(sluice_ckpt.Stager().max_bytes, 1 << 20)
        os.environ["SLUICE_CKPT_MAX_KEPT"] = "lots"
        with self.assertRaises(sluice_ckpt.SluiceError) as e:
            sluice_ckpt.Stager()
        self.assertIn("SLUICE_CKPT_MAX_KEPT: 'lots' is not a size", str(e.exception))

    def test_the_module_level_reserve_is_the_default_stagers(self):
        stager = sluice_ckpt.default_stager()
        self.addCleanup(stager.close)
        s = state(38)
        sluice_ckpt.reserve(s, wait=True)
        self.assertGreaterEqual(stager.kept_bytes(), state_bytes(s))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryTests(Base):
    def test_a_hundred_async_saves_keep_the_process_rss_flat(self):
        # Asynchronous saves must not grow host memory save after save (marin#6774: OOM-killed
        # after hours): one kept copy of the state, whatever the number of saves.
        stager = sluice_ckpt.Stager()
        self.addCleanup(stager.close)
        s = {"model": {"w": torch.randn(4 << 20)}, "optim": {"step": torch.tensor(0), "lr": 0.1}, "epoch": 0}
        futures, rss = [], {}
        for i in range(100):
            s["model"]["w"].add_(1.0)
            futures.append(sluice_ckpt.save(s, f"step-{i}", async_=True, stager=stager))
            if len(futures) > 1:  # what training does not wait for, the test cleans up after
                shutil.rmtree(os.path.dirname(futures.pop(0).result(timeout=60)))
            if i + 1 in (25, 100):
                rss[i + 1] = rss_bytes()
        futures.pop().result(timeout=60)
        state_bytes = 4 * (4 << 20)
        self.assertEqual(stager.kept_bytes(), state_bytes + s["optim"]["step"].element_size())
        self.assertEqual(stager.allocations, 1)
        # From save 25 (allocators settled) to save 100: less than one more copy of the state. The
        # copy per record this test was written against grew 2.8 MiB a save (210 MiB here).
        grown = rss[100] - rss[25]
        self.assertLess(
            grown, state_bytes, f"RSS grew {grown >> 20} MiB from save 25 to save 100 (one copy: {state_bytes >> 20} MiB)"
        )


class DeadlineTests(Base):
    """time_left()/should_save(): the job's end time from Slurm (a stand-in squeue here; the
    end-to-end test tests/tests/writer.rs asks the real one) against the recent saves' cost."""

    def setUp(self):
        super().setUp()
        from sluice_ckpt import deadline

        self.deadline = deadline
        deadline._durations.clear()
        deadline._end.update(at=None, asked=None)
        deadline._said.clear()
        self.addCleanup(deadline._durations.clear)
        self.addCleanup(deadline._said.clear)
        self.squeue_log = os.path.join(self.dir, "squeue.log")
        self.squeue = os.path.join(self.dir, "squeue")
        self.set_env("SLUICE_SQUEUE", self.squeue)

    def set_env(self, key, value):
        old = os.environ.get(key)
        os.environ[key] = value
        self.addCleanup(lambda: os.environ.pop(key, None) if old is None else os.environ.__setitem__(key, old))

    def squeue_says(self, text):
        with open(self.squeue, "w") as f:
            f.write(f"#!/bin/sh\necho \"$@\" >> {self.squeue_log}\necho '{text}'\n")
        os.chmod(self.squeue, 0o755)

    def ends_in(self, seconds):
        self.squeue_says(time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + seconds)))

    def test_the_time_left_is_slurms_end_time_asked_once_a_minute(self):
        self.ends_in(300)
        left = sluice_ckpt.time_left()
        self.assertTrue(297 <= left <= 301, left)
        sluice_ckpt.time_left()
        with open(self.squeue_log) as f:
            self.assertEqual(f.read().splitlines(), ["--noheader --jobs 4242 --format %e"])

    def test_no_time_limit_or_no_job_means_no_deadline(self):
        for answer in ("Unknown", "NONE", ""):
            self.deadline._end.update(at=None, asked=None)
            self.squeue_says(answer)
            self.assertIsNone(sluice_ckpt.time_left(), answer)
            self.assertFalse(sluice_ckpt.should_save(), answer)
        os.environ.pop("SLURM_JOB_ID")
        self.deadline._end.update(at=None, asked=None)
        self.assertIsNone(sluice_ckpt.end_time())

    def test_should_save_once_the_limit_is_nearer_than_a_save_and_the_margin(self):
        self.ends_in(100)
        self.assertFalse(sluice_ckpt.should_save(margin=60), "100 s left, nothing saved yet, margin 60 s")
        self.deadline.record_save(30.0)
        self.deadline.record_save(50.0)
        self.assertEqual(sluice_ckpt.save_cost(), 50.0)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertTrue(sluice_ckpt.should_save(margin=60), "100 s left, a save takes 50 s, margin 60 s")
            self.assertTrue(sluice_ckpt.should_save(margin=60))
        said = err.getvalue().splitlines()
        self.assertEqual(len(said), 1, said)
        self.assertIn("before job 4242's time limit; one save takes up to 50.0 s", said[0])

    def test_the_end_time_may_be_given(self):
        self.set_env("SLUICE_JOB_END_TIME", str(time.time() + 20))
        self.assertTrue(sluice_ckpt.should_save(margin=30))
        self.assertFalse(os.path.exists(self.squeue_log), "squeue was asked although the end time was given")

    def test_every_save_records_what_it_took(self):
        sluice_ckpt.save(state(40), "step-4000", commit=False)
        self.assertEqual(len(self.deadline._durations), 1)
        sluice_ckpt.save(state(41), "step-4100", commit=False, async_=True, stager=sluice_ckpt.Stager()).result(60)
        dcp.save(state(42), storage_writer=sluice_ckpt.SluiceWriter("step-4200", commit=False))
        self.assertEqual(len(self.deadline._durations), 3)
        self.assertGreater(sluice_ckpt.save_cost(), 0.0)


class LightningTests(Base):
    """SluiceCheckpointIO in a real Lightning Trainer (CPU): each checkpoint in its own tag
    directory, committed; a resume from the restored tag ends where an uninterrupted run does."""

    def setUp(self):
        super().setUp()
        try:
            import lightning  # noqa: F401
        except ImportError:
            self.skipTest("lightning is not installed (tests/harness/install.sh installs it)")

    def fit(self, ckpt_dir, steps, ckpt_path=None, top_k=-1, callbacks=()):
        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint

        from sluice_ckpt.lightning import SluiceCheckpointIO

        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 3)

            def training_step(self, batch, _):
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 3, generator=g)),
            batch_size=8,
        )
        torch.manual_seed(0)
        model = Model()
        every = ModelCheckpoint(
            dirpath=ckpt_dir, filename="step-{step}", auto_insert_metric_name=False,
            every_n_train_steps=4, save_top_k=top_k, monitor="step" if top_k > 0 else None, mode="max",
        )
        trainer = L.Trainer(
            max_steps=steps, plugins=[SluiceCheckpointIO()], callbacks=[every, *callbacks], accelerator="cpu", devices=1,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return model, trainer.optimizers[0].state_dict()["state"]

    def test_each_checkpoint_is_a_committed_tag_and_a_resume_ends_where_an_uninterrupted_run_does(self):
        from sluice_ckpt.lightning import restored_checkpoint

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            whole, whole_opt = self.fit(self.ckpt, 16, top_k=2)
        tags = ["step-4", "step-8", "step-12", "step-16"]
        self.assertEqual(sorted(os.listdir(self.ckpt)), sorted(tags), "one tag directory per checkpoint")
        for t in tags:
            self.assertEqual(os.listdir(os.path.join(self.ckpt, t)), [f"{t}.ckpt"])
        self.assertEqual(self.commits(), [["ckpt", "commit", t] for t in tags])
        self.assertIn("is left to sluice", err.getvalue(), "save_top_k's removals are sluice's retention's")

        self.assertIsNone(restored_checkpoint())
        os.environ["SLUICE_RESTORED_TAG"] = "step-8"
        self.addCleanup(os.environ.pop, "SLUICE_RESTORED_TAG", None)
        restored = restored_checkpoint()
        self.assertEqual(restored, os.path.join(self.ckpt, "step-8", "step-8.ckpt"))
        again = os.path.join(self.dir, "again")
        resumed, resumed_opt = self.fit(again, 16, ckpt_path=restored)
        for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
            self.assertTrue(torch.equal(a, b), f"{k} after the resume differs from the uninterrupted run")
        for k, st in whole_opt.items():
            self.assertTrue(torch.equal(st["momentum_buffer"], resumed_opt[k]["momentum_buffer"]), f"momentum {k}")
        self.assertEqual(sorted(os.listdir(again)), ["step-12", "step-16"], "the resumed run saves on from step 8")

    def test_a_final_save_stops_lightning_before_the_time_limit(self):
        from sluice_ckpt import deadline
        from sluice_ckpt.lightning import SluiceFinalSave

        deadline._said.clear()
        self.addCleanup(deadline._said.clear)
        os.environ["SLUICE_JOB_END_TIME"] = str(time.time() + 30)
        self.addCleanup(os.environ.pop, "SLUICE_JOB_END_TIME", None)
        final = SluiceFinalSave(margin=1000)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.fit(self.ckpt, 16, callbacks=[final])
        self.assertEqual(final.final_step, 1, "30 s left and a margin of 1000 s: save after the first step")
        self.assertEqual(os.listdir(os.path.join(self.ckpt, "step-1")), ["step-1.ckpt"])
        self.assertEqual(self.commits(), [["ckpt", "commit", "step-1"]])
        self.assertIn("sluice_ckpt: final save before the time limit: step-1", err.getvalue())


class HuggingFaceTests(Base):
    """SluiceCallback in a real transformers Trainer (CPU, a tiny BERT built from its config, no
    download): every checkpoint committed; a resume from the restored tag ends where an
    uninterrupted run does; the final save before the time limit."""

    def setUp(self):
        super().setUp()
        try:
            import transformers  # noqa: F401
        except ImportError:
            self.skipTest("transformers is not installed (tests/harness/install.sh installs it)")
        from sluice_ckpt import deadline

        deadline._said.clear()
        self.addCleanup(deadline._said.clear)

    def train(self, output_dir, steps, resume=None, callback=None):
        from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

        from sluice_ckpt.hf import SluiceCallback

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 32

            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                return {"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 2)}

        torch.manual_seed(0)
        config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, num_labels=2)
        model = BertForSequenceClassification(config)
        args = TrainingArguments(output_dir=output_dir, max_steps=steps, save_steps=4, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, logging_strategy="no", seed=0, data_seed=0)
        callback = callback or SluiceCallback()
        trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[callback])
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer

    def test_each_checkpoint_is_committed_and_a_resume_ends_where_an_uninterrupted_run_does(self):
        from sluice_ckpt.hf import restored_checkpoint

        whole, _ = self.train(self.ckpt, 8)
        self.assertEqual(sorted(os.listdir(self.ckpt)), ["checkpoint-4", "checkpoint-8"])
        self.assertEqual(self.commits(), [["ckpt", "commit", "checkpoint-4"], ["ckpt", "commit", "checkpoint-8"]])
        self.assertIsNone(restored_checkpoint())
        os.environ["SLUICE_RESTORED_TAG"] = "checkpoint-4"
        self.addCleanup(os.environ.pop, "SLUICE_RESTORED_TAG", None)
        self.assertEqual(restored_checkpoint(), os.path.join(self.ckpt, "checkpoint-4"))
        again = os.path.join(self.dir, "again")
        resumed, _ = self.train(again, 8, resume=restored_checkpoint(), callback=self.uncommitted())
        for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
            self.assertTrue(torch.equal(a, b), f"{k} after the resume differs from the uninterrupted run")

    def uncommitted(self):
        from sluice_ckpt.hf import SluiceCallback

        return SluiceCallback(commit=False)

    def test_the_output_dir_must_be_the_jobs_checkpoint_directory(self):
        elsewhere = os.path.join(self.dir, "elsewhere")
        with self.assertRaises(sluice_ckpt.SluiceError) as e:
            self.train(elsewhere, 4)
        self.assertIn("is not $SLUICE_CKPT_DIR", str(e.exception))

    def test_a_final_save_stops_the_trainer_before_the_time_limit(self):
        from sluice_ckpt.hf import SluiceCallback

        os.environ["SLUICE_JOB_END_TIME"] = str(time.time() + 30)
        self.addCleanup(os.environ.pop, "SLUICE_JOB_END_TIME", None)
        callback = SluiceCallback(final_save_margin=1000)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            _, trainer = self.train(self.ckpt, 8, callback=callback)
        self.assertEqual((callback.final_step, trainer.state.global_step), (1, 1))
        self.assertEqual(self.commits(), [["ckpt", "commit", "checkpoint-1"]])
        self.assertIn("sluice_ckpt: final save before the time limit: step 1", err.getvalue())


class SaveTests(Base):
    def test_save_writes_torch_save_bytes_and_commits(self):
        s = state(5)
        path = sluice_ckpt.save(s, "step-500")
        self.assertEqual(path, os.path.join(self.ckpt, "step-500", "state.pt"))
        self.assertEqual(self.commits(), [["ckpt", "commit", "step-500"]])
        self.assertStateEqual(sluice_ckpt.load("step-500"), s)
        self.assertStateEqual(torch.load(path, weights_only=False), s)


class WriterTests(Base):
    SIZES = [0, 1, 4095, 4096, 4097, 1 << 20, (8 << 20) + 13]

    def roundtrip(self, directory):
        for i, n in enumerate(self.SIZES):
            data = os.urandom(n)
            path = os.path.join(directory, f"f{n}")
            with sluice_ckpt.Writer(path, block_size=1 << 20) as w:
                # bytes, a bytearray's memoryview, a tensor: the three ways callers hand bytes over
                third = n // 3
                w.write(data[:third])
                w.write(memoryview(bytearray(data[third : 2 * third])))
                t = torch.frombuffer(bytearray(data[2 * third :]), dtype=torch.uint8) if n - 2 * third else torch.empty(0, dtype=torch.uint8)
                self.assertEqual(w.write_tensor(t), "host")
                self.assertEqual(w.tell(), n)
            with open(path, "rb") as f:
                self.assertEqual(f.read(), data, f"{n} bytes in {directory}")

    def test_files_are_byte_identical_on_disk(self):
        self.roundtrip(self.dir)

    def test_files_are_byte_identical_on_tmpfs(self):
        if not os.path.isdir("/dev/shm"):
            self.skipTest("no /dev/shm")
        d = tempfile.mkdtemp(dir="/dev/shm")
        self.addCleanup(shutil.rmtree, d, True)
        self.roundtrip(d)

    def test_a_write_error_names_the_file(self):
        with self.assertRaises(sluice_ckpt.SluiceError) as e:
            sluice_ckpt.Writer(os.path.join(self.dir, "no", "such", "dir", "f"))
        self.assertIn("no/such/dir/f", str(e.exception))

    def test_the_cufile_probe_says_unavailable_in_under_a_second(self):
        start = time.monotonic()
        available, why = sluice_ckpt.probe_cufile(refresh=True)
        took = time.monotonic() - start
        print(f"\ncuFile probe of {sluice_ckpt.cufile_library()}: {why} ({took:.3f} s)", file=sys.stderr)
        self.assertLess(took, 1.0)
        if not torch.cuda.is_available():
            self.assertFalse(available)
            self.assertTrue(why.startswith("unavailable: "), why)


class PipInstallTests(unittest.TestCase):
    def test_pip_install_bundles_the_built_library(self):
        target = tempfile.mkdtemp(prefix="sluice-ckpt-pip-")
        self.addCleanup(shutil.rmtree, target, True)
        build = tempfile.mkdtemp(prefix="sluice-ckpt-src-")
        self.addCleanup(shutil.rmtree, build, True)
        # pip builds in the source tree: build a copy of it, so the checkout stays clean, next to
        # the workspace's target directory, as `pip install ./python` in a checkout sees it.
        src = os.path.join(build, "python")
        shutil.copytree(PKG_ROOT, src, ignore=shutil.ignore_patterns("tests", "__pycache__", "build", "*.egg-info"))
        env = dict(os.environ, SLUICE_WRITER_LIB_DIR=os.path.dirname(sluice_ckpt.library_path()))
        env.pop("SLUICE_WRITER_LIB", None)
        p = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
             "--disable-pip-version-check", "--target", target, src],
            capture_output=True, text=True, env=env, timeout=600,
        )
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        env.pop("SLUICE_WRITER_LIB_DIR")
        q = subprocess.run(
            [sys.executable, "-c", "import sluice_ckpt; print(sluice_ckpt.library_path())"],
            capture_output=True, text=True, env=dict(env, PYTHONPATH=target), cwd="/", timeout=120,
        )
        self.assertEqual(q.returncode, 0, q.stderr)
        self.assertEqual(q.stdout.strip(), os.path.join(target, "sluice_ckpt", "lib", "libsluice_writer.so"))
        self.assertTrue(os.path.isfile(os.path.join(target, "sluice_ckpt", "lib", "sluice-cufile-probe")))


if __name__ == "__main__":
    unittest.main()
