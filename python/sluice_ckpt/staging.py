"""The staging copy of an asynchronous save: one copy into buffers kept from save to save.

A save that must not stall training copies the state dict once, on the training thread, into a
CPU copy that training cannot touch, and writes that copy in the background. DCP's stock staging
allocates that copy anew at every save (page faults on every byte: 4x a plain memcpy of the same
bytes). A Stager keeps it: the first save allocates it (pinned when CUDA is there, so the
device-to-host copy is a DMA), every later save of a state dict of the same structure (keys,
shapes, dtypes) copies into the same tensors, with pages already faulted in.

One buffer, so a save must not start copying into it while the previous save still writes from
it: `stage()` waits until the previous save released its lease — when its background write
returned (the bytes are in the files; what is left, the metadata and the commit, does not read
the buffer), or when the thread that wrote it ended (a save that failed). In a training loop the
previous save finished long before the next one starts, and the wait is nothing; a loop that
saves faster than the tier takes the bytes waits here instead of overwriting a checkpoint in
flight.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ._lib import once

__all__ = ["Lease", "Stager", "default_stager"]


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

    pin_memory: None (default) pins them when CUDA is available. Not for concurrent stage()
    calls from several threads: one training thread saves."""

    def __init__(self, pin_memory=None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._cond = threading.Condition()
        self._lease = None
        self._signature = None
        self._cache = None
        self.allocations = 0  # how many times the buffers were (re)allocated
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

    def stage(self, state_dict):
        """Copy state_dict into the kept buffers (after the previous save released them);
        returns (the staged state dict, its Lease). The caller releases the lease when its
        write no longer reads the staged tensors, or binds it to the thread that writes them."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        lease = self._wait_free()
        try:
            sig = _signature(state_dict)
            if self._cache is None or sig != self._signature:
                self._cache = None  # the old buffers go before the new ones are allocated
                self._cache = _create_cpu_state_dict(state_dict, pin_memory=self.pin_memory)
                self._signature = sig
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
        self.wait()
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)
        self._cache = None
        self._signature = None


@once
def default_stager():
    """The process's Stager, shared by SluiceWriter (dcp.async_save) and save(async_=True)."""
    return Stager()
