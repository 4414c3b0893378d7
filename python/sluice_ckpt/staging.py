"""The staging copy of an asynchronous save: one copy into buffers kept from save to save.

A save that must not stall training copies the state dict once, on the training thread, into a
CPU copy that training cannot touch, and writes that copy in the background. DCP's stock staging
allocates that copy anew at every save (page faults on every byte: 4x a plain memcpy of the same
bytes). A Stager keeps it: the first save allocates it (pinned when CUDA is there, so the
device-to-host copy is a DMA), every later save of a state dict of the same structure (keys,
shapes, dtypes) copies into the same tensors, with pages already faulted in.

The first save need not allocate: `reserve(state)` allocates the buffers in a background thread
from a state dict or a model (only its shapes and dtypes are read), at set-up, while training
starts; a save that comes before the reserve finished waits only for what is left of it. Pinning
costs about a second per GiB, so without a reserve the first save of a large model stalls training
for as long (issue 31). `kept_bytes()` is what the buffers hold, reserved or kept.

One buffer, so a save must not start copying into it while the previous save still writes from
it: `stage()` waits until the previous save released its lease — when its background write
returned (the bytes are in the files; what is left, the metadata and the commit, does not read
the buffer), or when the thread that wrote it ended (a save that failed). In a training loop the
previous save finished long before the next one starts, and the wait is nothing; a loop that
saves faster than the tier takes the bytes waits here instead of overwriting a checkpoint in
flight.
"""

import errno
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ._lib import SluiceError, once

__all__ = ["Lease", "Stager", "default_stager", "reserve"]


def _signature(obj):
    """What must match for the staged copy to be reused: the containers' keys and every tensor's
    type, shape, dtype (and a DTensor's local shape)."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)
        return (
            type(obj).__name__,
            tuple(obj.shape),
            obj.dtype,
            None if local is None else tuple(local.shape),
        )
    if isinstance(obj, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_signature(v) for v in obj))
    # Plain values (ints, floats, strings) are taken as they are at each save.
    return "value"


def _tensor_bytes(obj):
    """The bytes of every tensor in obj (a DTensor's local shard)."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", obj)
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _fault_in(obj):
    """Touches every page of obj's tensors, so that the first copy into them is a plain memcpy
    rather than a page fault per 4 KiB (pinned memory is resident already)."""
    if isinstance(obj, torch.Tensor):
        getattr(obj, "_local_tensor", obj).zero_()
    elif isinstance(obj, dict):
        for v in obj.values():
            _fault_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _fault_in(v)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text):
    """Bytes from "68719476736", "64GiB", "64G" or "512 MiB" (binary units); raises ValueError."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 64GiB, 512MiB, or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _gib(n):
    return f"{n / (1 << 30):.1f} GiB"


class _Reservation:
    """Buffers being allocated in the background for state dicts of one signature."""

    def __init__(self, signature, nbytes):
        self.signature = signature
        self.nbytes = nbytes
        self.buffers = None
        self.error = None
        self.thread = None


def _has_cuda_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cuda"
    if isinstance(obj, dict):
        return any(_has_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_cuda_tensor(v) for v in obj)
    return False


class Lease:
    """One save's hold on a Stager's buffer; released when its write no longer reads it."""

    def __init__(self, stager):
        self._stager = stager
        self._done = threading.Event()
        self._thread = None

    def bind(self, thread):
        """The thread that writes from the buffer: its end releases the lease (a failed save)."""
        if self._thread is None:
            self._thread = thread

    def release(self):
        if not self._done.is_set():
            self._done.set()
            with self._stager._cond:
                self._stager._cond.notify_all()

    def released(self):
        t = self._thread
        return self._done.is_set() or (t is not None and not t.is_alive())


class Stager:
    """Copies state dicts into CPU buffers kept from save to save (see the module's text).

    pin_memory: None (default) pins them when CUDA is available. max_bytes: the most its buffers
    may hold (None: $SLUICE_CKPT_MAX_KEPT, e.g. "64GiB"; unset: no cap); a save or reserve of a
    state that needs more is refused before anything is allocated or copied. Not for concurrent
    stage() calls from several threads: one training thread saves."""

    def __init__(self, pin_memory=None, max_bytes=None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        if max_bytes is None and os.environ.get("SLUICE_CKPT_MAX_KEPT"):
            try:
                max_bytes = parse_size(os.environ["SLUICE_CKPT_MAX_KEPT"])
            except ValueError as e:
                raise SluiceError(errno.EINVAL, f"SLUICE_CKPT_MAX_KEPT: {e}") from None
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._lease = None
        self._signature = None
        self._cache = None
        self._cache_bytes = 0
        self._reservation = None
        self.allocations = 0  # how many times the buffers were (re)allocated (a reserve included)
        self._writer = None
        self._writer_lock = threading.Lock()

    def writer(self):
        """The executor that runs save(async_=True)'s writes from this stager's buffer, one at a
        time, in order (one thread, started by the first save; interpreter exit waits for the
        writes it holds, as for any ThreadPoolExecutor)."""
        with self._writer_lock:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice_ckpt.save")
            return self._writer

    def _wait_free(self):
        with self._cond:
            while self._lease is not None and not self._lease.released():
                # A lease's thread can end without releasing it (a failed save): look again.
                self._cond.wait(0.05)
            self._lease = Lease(self)
            return self._lease

    def wait(self):
        """Wait until no save writes from the buffer."""
        with self._cond:
            while self._lease is not None and not self._lease.released():
                self._cond.wait(0.05)

    def reserve(self, state, wait=False):
        """Allocates the buffers a save of `state` will copy into, in a background thread, so that
        the first save does not: call it at set-up with the model, or with the state dict the
        saves will take (an optimizer's state exists after its first step). Only shapes and
        dtypes are read; the values may change meanwhile. A save that comes before the reserve
        finished waits for what is left of it; a save of another structure drops it.

        Bounded: one copy of `state` — kept buffers of another structure are freed (once no save
        writes from them) before the new ones are allocated, a reserve replaces the one before it,
        and none is made where the kept buffers already fit. wait=True returns once the buffers
        are allocated (and raises what failed)."""
        if isinstance(state, torch.nn.Module):
            state = state.state_dict()
        self._check_cap(state)
        sig = _signature(state)
        previous = self._reservation
        fits = previous.signature == sig if previous is not None else (
            self._cache is not None and sig == self._signature
        )
        if not fits:
            r = _Reservation(sig, _tensor_bytes(state))
            r.thread = threading.Thread(
                target=self._allocate, args=(r, state, previous), name="sluice_ckpt.reserve", daemon=True
            )
            self._reservation = r
            r.thread.start()
        if wait:
            r = self._join_reservation(keep=sig)
            if r is not None and r.error is not None:
                raise r.error

    def _allocate(self, r, state, previous):
        from torch.distributed._state_dict_utils import _create_cpu_state_dict

        try:
            if previous is not None:  # a reserve of another structure: its buffers go first
                previous.thread.join()
                previous.buffers = None
            self.wait()  # the kept buffers may be written from: free them only after that
            if self._signature != r.signature:
                self._cache, self._signature, self._cache_bytes = None, None, 0
            buffers = _create_cpu_state_dict(state, pin_memory=self.pin_memory)
            if not self.pin_memory:
                _fault_in(buffers)
            r.buffers = buffers
        except BaseException as e:  # reported by the save that would have used it
            r.error = e

    def _join_reservation(self, keep):
        """Waits for the reserve in progress, if any, and adopts its buffers where they are for
        signature `keep`; drops them otherwise. Returns the reservation (or None)."""
        r, self._reservation = self._reservation, None
        if r is None:
            return None
        r.thread.join()
        if r.signature == keep and r.buffers is not None:
            self._cache, self._signature, self._cache_bytes = r.buffers, r.signature, r.nbytes
            self.allocations += 1
        r.buffers = None
        return r

    def _check_cap(self, state):
        need = _tensor_bytes(state)
        if self.max_bytes is not None and need > self.max_bytes:
            raise SluiceError(
                errno.ENOMEM,
                f"an asynchronous save of this state needs {_gib(need)} of kept host buffers, above "
                f"the cap of {_gib(self.max_bytes)} (Stager max_bytes, SLUICE_CKPT_MAX_KEPT): save it "
                "synchronously (sluice_ckpt.save without async_, dcp.save), shard it over more ranks, "
                "or raise the cap; nothing was copied or saved",
            )

    def kept_bytes(self):
        """The bytes of the buffers this stager keeps or is reserving: what its saves hold in host
        memory between saves (pinned where CUDA is), over one copy of the state."""
        r = self._reservation
        return self._cache_bytes + (r.nbytes if r is not None else 0)

    def stage(self, state_dict):
        """Copy state_dict into the kept buffers (after the previous save released them);
        returns (the staged state dict, its Lease). The caller releases the lease when its
        write no longer reads the staged tensors, or binds it to the thread that writes them."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        self._check_cap(state_dict)
        sig = _signature(state_dict)
        self._join_reservation(keep=sig)
        lease = self._wait_free()
        try:
            if self._cache is None or sig != self._signature:
                # The old buffers go before the new ones are allocated.
                self._cache, self._signature, self._cache_bytes = None, None, 0
                self._cache = _create_cpu_state_dict(state_dict, pin_memory=self.pin_memory)
                self._signature = sig
                self._cache_bytes = _tensor_bytes(state_dict)
                self.allocations += 1
            cuda = _has_cuda_tensor(state_dict)
            staged = _copy_state_dict(state_dict, self._cache, non_blocking=cuda and self.pin_memory)
            if cuda:
                torch.cuda.synchronize()
        except BaseException:
            lease.release()
            raise
        return staged, lease

    def close(self):
        """Free the buffers (after the save in flight, if any) and stop the writer thread."""
        self._join_reservation(keep=None)
        self.wait()
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)
        self._cache, self._signature, self._cache_bytes = None, None, 0


@once
def default_stager():
    """The process's Stager, shared by SluiceWriter (dcp.async_save) and save(async_=True)."""
    return Stager()


def reserve(state, wait=False):
    """default_stager().reserve(state, wait): the buffers of the process's asynchronous saves,
    allocated in the background before the first save (see Stager.reserve)."""
    default_stager().reserve(state, wait=wait)
