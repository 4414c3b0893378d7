"""ctypes over libsluice_writer.so (writer/include/sluice_writer.h): finding the library, a
`Writer` for one file, the cuFile probe, and the commit.

Where the library is, first found:
1. $SLUICE_WRITER_LIB (the path of libsluice_writer.so; sluice-cufile-probe beside it);
2. the copy `pip install` bundled into the package (sluice_ckpt/lib/);
3. the workspace this package sits in, when it is used from a checkout (PYTHONPATH=python):
   target/release, then target/debug.
"""

import contextlib
import ctypes
import errno
import functools
import glob
import os
import shutil
import subprocess
import sys
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))


class SluiceError(OSError):
    """A write, a probe or a commit failed; the message says which file and why."""


def library_path():
    """The libsluice_writer.so this package uses (see the module's doc), or raises SluiceError."""
    env = os.environ.get("SLUICE_WRITER_LIB")
    if env:
        if not os.path.isfile(env):
            raise SluiceError(errno.ENOENT, f"SLUICE_WRITER_LIB={env}: no such file")
        return env
    repo = os.path.dirname(os.path.dirname(_HERE))
    for cand in (
        os.path.join(_HERE, "lib", "libsluice_writer.so"),
        os.path.join(repo, "target", "release", "libsluice_writer.so"),
        os.path.join(repo, "target", "debug", "libsluice_writer.so"),
    ):
        if os.path.isfile(cand):
            return cand
    raise SluiceError(
        errno.ENOENT,
        "libsluice_writer.so not found: build it (cargo build --release -p sluice-writer) and "
        "reinstall this package (pip install ./python), or set SLUICE_WRITER_LIB to its path",
    )


def once(make):
    """`make` made into a function that calls it once per process, even when threads ask at the
    same time, and returns that result from then on (a call that raised is tried again)."""
    lock = threading.Lock()
    made = []

    @functools.wraps(make)
    def get():
        with lock:
            if not made:
                made.append(make())
            return made[0]

    return get


@once
def lib():
    """The loaded library, with its functions' types declared (once per process)."""
    # CDLL: ctypes releases the GIL for every call, so DCP's writer threads and the
    # training thread run while a block is written.
    l = ctypes.CDLL(library_path())
    vp, sz, i, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
    l.sluice_writer_open.argtypes, l.sluice_writer_open.restype = [cp, sz], vp
    l.sluice_writer_write.argtypes, l.sluice_writer_write.restype = [vp, vp, sz], i
    l.sluice_writer_write_cuda.argtypes, l.sluice_writer_write_cuda.restype = [vp, vp, sz], i
    l.sluice_writer_position.argtypes, l.sluice_writer_position.restype = [vp], ctypes.c_int64
    l.sluice_writer_is_direct.argtypes, l.sluice_writer_is_direct.restype = [vp], i
    l.sluice_writer_close.argtypes, l.sluice_writer_close.restype = [vp], i
    l.sluice_writer_abort.argtypes, l.sluice_writer_abort.restype = [vp], None
    l.sluice_writer_last_error.argtypes, l.sluice_writer_last_error.restype = [], cp
    l.sluice_writer_version.argtypes, l.sluice_writer_version.restype = [], cp
    l.sluice_cufile_probe.argtypes = [cp, ctypes.c_uint, ctypes.c_char_p, sz]
    l.sluice_cufile_probe.restype = i
    return l


def _fail(rc, what):
    msg = (lib().sluice_writer_last_error() or b"").decode(errors="replace")
    raise SluiceError(-rc if rc < 0 else errno.EIO, f"{what}: {msg}")


# --------------------------------------------------------------------------------- the cuFile probe

_probe = None


def cufile_library():
    """The libcufile to probe: $SLUICE_CUFILE_LIB; else the one PyPI's nvidia-cufile installed (the
    CUDA wheels of torch bring it) in this Python's site-packages; else libcufile.so.0 on the
    loader's path."""
    env = os.environ.get("SLUICE_CUFILE_LIB")
    if env:
        return env
    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cufile/lib", "nvidia/cu12/lib"):
            hits = glob.glob(os.path.join(base, sub, "libcufile.so.0"))
            if hits:
                return hits[0]
    return "libcufile.so.0"


def probe_cufile(timeout=10.0, refresh=False):
    """(available, reason): whether CUDA tensors can be written with GPUDirect Storage here. Runs the
    library's probe (a child process, killed after `timeout` s) once per process. Where GDS is not
    set up the answer comes at once (well under a second); where it is, opening the driver creates
    a CUDA context, which may take seconds."""
    global _probe
    if _probe is None or refresh:
        why = ctypes.create_string_buffer(512)
        rc = lib().sluice_cufile_probe(
            cufile_library().encode(), int(timeout * 1000), why, len(why)
        )
        if rc < 0:
            _fail(rc, "cuFile probe")
        _probe = (rc == 1, why.value.decode(errors="replace"))
    return _probe


# ------------------------------------------------------------------------------------------ a file


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (Include/pybuffer.h), filled by PyObject_GetBuffer."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


@once
def _buffer_api():
    api = ctypes.pythonapi
    api.PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    api.PyObject_GetBuffer.restype = ctypes.c_int
    api.PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
    api.PyBuffer_Release.restype = None
    return api


@contextlib.contextmanager
def _buffer_address(contiguous):
    """The address of a C-contiguous buffer's bytes, held for the block: read-only ones too
    (torch.save hands its records over as read-only memoryviews), without copying them. A copy
    (memoryview.tobytes) would double the memory of every record — a whole tensor's bytes for a
    moment, and glibc keeps much of it: 25x the state in RSS after 100 saves of 16 MiB."""
    api = _buffer_api()
    view = _PyBuffer()
    if api.PyObject_GetBuffer(contiguous, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise BufferError("the buffer cannot be read in place")
    try:
        yield view.buf
    finally:
        api.PyBuffer_Release(ctypes.byref(view))


class Writer:
    """One file written through libsluice_writer: aligned, several writer threads, O_DIRECT where
    the file system takes it, fsynced and renamed into place by close(). A context manager: leaving
    the block normally closes the file, leaving it with an exception abandons it (the unfinished
    file is removed; the name keeps what it held)."""

    def __init__(self, path, block_size=0):
        self.path = os.fspath(path)
        self._w = lib().sluice_writer_open(self.path.encode(), block_size)
        if not self._w:
            _fail(-errno.EIO, f"open {self.path}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _handle(self):
        if not self._w:
            raise ValueError(f"{self.path}: the writer is closed")
        return self._w

    @property
    def is_direct(self):
        return lib().sluice_writer_is_direct(self._handle()) == 1

    def tell(self):
        pos = lib().sluice_writer_position(self._handle())
        if pos < 0:
            _fail(pos, f"position of {self.path}")
        return pos

    def write(self, data):
        """Appends a bytes-like object (copied before this returns); returns its length."""
        mv = memoryview(data)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        n = mv.nbytes
        if n == 0:
            return 0
        with _buffer_address(mv) as address:
            rc = lib().sluice_writer_write(self._handle(), address, n)
        if rc != 0:
            _fail(rc, f"write {self.path}")
        return n

    def write_ptr(self, address, nbytes):
        """Appends `nbytes` of host memory at `address` (a tensor's data_ptr())."""
        if nbytes:
            rc = lib().sluice_writer_write(self._handle(), ctypes.c_void_p(address), nbytes)
            if rc != 0:
                _fail(rc, f"write {self.path}")

    def write_tensor(self, tensor, cuda_path="auto", bounce_bytes=64 << 20):
        """Appends a tensor's raw bytes (its storage order, contiguous). Host tensors are copied
        from their memory into the aligned buffers. CUDA tensors: cuda_path "cufile" writes them
        GPU -> file with cuFileWrite (GPUDirect Storage; fails where the probe says unavailable),
        "bounce" copies them through two pinned host buffers of `bounce_bytes` (the
        GPU fills one while the other is copied into the writer's blocks), "auto" takes cuFile
        where the probe says available and the file is open with O_DIRECT, else the bounce buffer.
        Returns the path taken: "host", "cufile" or "bounce"."""
        import torch

        t = tensor.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if not t.is_cuda:
            self.write_ptr(t.data_ptr(), nbytes)
            return "host"
        if nbytes == 0:
            return "bounce"
        if cuda_path not in ("auto", "cufile", "bounce"):
            raise ValueError(f"cuda_path must be auto, cufile or bounce, not {cuda_path!r}")
        if cuda_path in ("auto", "cufile"):
            available, why = probe_cufile()
            if available and self.is_direct:
                torch.cuda.current_stream(t.device).synchronize()
                rc = lib().sluice_writer_write_cuda(self._handle(), ctypes.c_void_p(t.data_ptr()), nbytes)
                if rc == 0:
                    return "cufile"
                if cuda_path == "cufile":
                    _fail(rc, f"cuFile write of {self.path}")
            elif cuda_path == "cufile":
                raise SluiceError(
                    errno.EOPNOTSUPP,
                    f"{self.path}: cuFile cannot be used: {why if not available else 'the file is not open with O_DIRECT'}",
                )
        # Two pinned buffers: the GPU copies chunk i+1 into one (asynchronously, on the current
        # stream) while chunk i is copied from the other into the writer's aligned blocks.
        flat = t.reshape(-1).view(torch.uint8)
        step = max(4096, bounce_bytes // 4096 * 4096)
        bufs = _pinned_pair(min(step, nbytes))
        stream = torch.cuda.current_stream(t.device)
        pending = []
        for i, start in enumerate(range(0, nbytes, step)):
            n = min(step, nbytes - start)
            host = bufs[i % 2][:n]
            with torch.cuda.stream(stream):
                host.copy_(flat[start : start + n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            pending.append((host, done))
            if len(pending) == 2:
                h, e = pending.pop(0)
                e.synchronize()
                self.write_ptr(h.data_ptr(), h.numel())
        for h, e in pending:
            e.synchronize()
            self.write_ptr(h.data_ptr(), h.numel())
        return "bounce"

    def flush(self):
        """Nothing to do: blocks go to the file as they fill, and close() writes the rest and
        fsyncs (for torch.save and io's file protocol)."""

    def close(self):
        """Writes the rest, fsyncs; the file is complete and durable when this returns."""
        w, self._w = self._w, None
        if w:
            rc = lib().sluice_writer_close(w)
            if rc != 0:
                _fail(rc, f"close {self.path}")

    def abort(self):
        """Abandons the file: nothing more is written, the unfinished file is removed."""
        w, self._w = getattr(self, "_w", None), None
        if w:
            lib().sluice_writer_abort(w)

    def __del__(self):
        self.abort()


_pinned = threading.local()


def _pinned_pair(nbytes):
    """Two pinned host buffers of at least `nbytes` each, kept per thread (pinning memory is
    expensive: it is done once, not per tensor)."""
    import torch

    pair = getattr(_pinned, "pair", None)
    if pair is None or pair[0].numel() < nbytes:
        pair = tuple(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        _pinned.pair = pair
    return pair


def fsync_dir(path):
    """Makes a file's creation or a rename in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ commit


def ckpt_dir(ckpt_dir=None):
    """The directory checkpoints go in: the argument, else $SLUICE_CKPT_DIR."""
    d = ckpt_dir or os.environ.get("SLUICE_CKPT_DIR")
    if not d:
        raise SluiceError(
            errno.ENOENT,
            "SLUICE_CKPT_DIR is not set: run inside a Slurm job started with sluice's checkpoint "
            "options (e.g. --ckpt-archive=URL), or pass ckpt_dir=",
        )
    return d


def check_tag(tag):
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or "\0" in tag:
        raise ValueError(f"checkpoint tag {tag!r}: one plain directory name, e.g. 'step-100'")
    return tag


def should_commit(commit):
    """commit=None means: inside a Slurm job (SLURM_JOB_ID set), yes; elsewhere, no."""
    return bool(os.environ.get("SLURM_JOB_ID")) if commit is None else bool(commit)


def commit(tag, sluice=None, timeout=300):
    """`sluice ckpt commit TAG`: the agent archives the tag (idempotent: committing a tag twice, or
    one DCP's .metadata already signalled, is harmless). `sluice`: the CLI's path; else
    $SLUICE_CLI; else `sluice` on PATH. Returns what the CLI said; raises SluiceError if it failed."""
    cli = sluice or os.environ.get("SLUICE_CLI") or shutil.which("sluice")
    if not cli:
        raise SluiceError(
            errno.ENOENT,
            f"cannot commit {tag}: the sluice CLI is not on PATH (set SLUICE_CLI or pass sluice=)",
        )
    p = subprocess.run([cli, "ckpt", "commit", tag], capture_output=True, text=True, timeout=timeout)
    said = (p.stdout + p.stderr).strip()
    if p.returncode == 0:
        return said
    # The agent may have committed the tag itself in the meantime, from DCP's .metadata signal,
    # and archived it (or, on a multi-node job, be waiting for the other nodes' parts): it then
    # refuses a second commit of a tag it holds as immutable. That is this save's commit, done.
    # A tag the archive holds with other content stays an error (its state is "refused").
    state = _agent_state(cli, tag, timeout)
    if state in _COMMITTED_STATES:
        return f"{tag} is already committed ({state}): {said}"
    raise SluiceError(errno.EIO, f"sluice ckpt commit {tag} exited {p.returncode}: {said}")


def poison(tag, reason, *, url=None, sluice=None, timeout=300):
    """`sluice ckpt poison TAG --reason REASON`: marks a checkpoint of this job bad (e.g. on a NaN
    loss, or $SLUICE_RESTORED_TAG when the run diverges right after restoring it), at the job's
    archive, archived yet or not. `--ckpt-restore=latest` then never restores it, and says why in
    the next job's output; a named restore of it needs TAG!. With url=, the archived checkpoint
    at that archive URL (outside a job). Written once: poisoning a tag again keeps the first
    reason. Only the checkpoint's owner (or root) may poison it. Returns what the CLI said;
    raises SluiceError if it failed."""
    tag = check_tag(tag)
    reason = " ".join(str(reason).split())
    if not reason:
        raise ValueError("poison needs a reason: it is what the next job's output shows")
    cli = sluice or os.environ.get("SLUICE_CLI") or shutil.which("sluice")
    if not cli:
        raise SluiceError(
            errno.ENOENT,
            f"cannot poison {tag}: the sluice CLI is not on PATH (set SLUICE_CLI or pass sluice=)",
        )
    where = [url] if url else []
    p = subprocess.run(
        [cli, "ckpt", "poison", *where, tag, "--reason", reason],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    said = (p.stdout + p.stderr).strip()
    if p.returncode != 0:
        raise SluiceError(errno.EIO, f"sluice ckpt poison {tag} exited {p.returncode}: {said}")
    return said


#: What `sluice ckpt list --json` says of a tag whose commit the agent holds and works on or did.
_COMMITTED_STATES = {
    "committed",
    "archiving",
    "waiting-for-nodes",
    "waiting_for_nodes",
    "retrying",
    "archived",
}


def _agent_state(cli, tag, timeout):
    """This job's `tag` as the node's agent lists it (its state), or None."""
    import json

    try:
        p = subprocess.run([cli, "ckpt", "list", "--json"], capture_output=True, text=True, timeout=timeout)
        for c in json.loads(p.stdout).get("ckpts", []):
            if c.get("tag") == tag:
                return c.get("state")
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return None
