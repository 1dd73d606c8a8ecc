"""The cross-rank consistency check run before every collective.

Imports numpy, mpi4py and meta_dist.xp. The ranks compare a fingerprint of (operation, op,
root, dtype, shapes, array kind) with one small allreduce (max of x and of -x gives max and min
at once); on a difference every rank raises the same ValueError listing each rank's arrays. A
rank that refused its own arguments sends a pair no call has, so its peers fail the same call
at once instead of waiting for it. With the per-call check off, ``advised`` makes a failing
MPI call say how to see which ranks differ; ``agree_settings`` compares, once, the settings
that decide which calls a collective makes. (A rank that never arrives is the stall watchdog's:
``meta_dist.watchdog``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meta_dist.lazy_mpi import MPI
from meta_dist.xp import is_cupy_array

KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "send", "recv",
         "barrier")
NO_ARRAYS = np.empty(0, np.uint8)  # what a call without arrays (barrier) is fingerprinted by
# What a rank that refused its own arguments sends: no call's pair, since codes are below 2**62.
REFUSED_PAIR = np.array([1 << 62, 1 << 62], np.int64).tobytes()
REFUSED_MARK = "refused "


def shape_code(shapes: Sequence[tuple[int, ...]]) -> int:
    """Return a deterministic 62-bit code of a list of shapes (same on every rank and run)."""
    code = 1469598103934665603
    for shape in shapes:
        for dim in (len(shape), *shape):
            code = ((code ^ (dim + 0x9E37)) * 1099511628211) % (1 << 62)
        code = (code * 31 + 7) % (1 << 62)
    return code


class ConsistencyCheck:
    """Compare every rank's call before a collective runs (or, with ``every_call`` off, later).

    A call's fingerprint (operation, op, root, dtype, shapes, array kind) is hashed once per
    distinct call and cached, and the ranks allreduce (max) the pair (h, -h): the result says
    max(h) and -min(h), which differ exactly when some rank's call differs. Only then is a
    second, pickled exchange made to name each field that differs, with every rank's value.
    With ``every_call`` off the fingerprints are folded into a running hash instead, and
    ``settle`` compares that (at a barrier, an epoch's end, close): a call that differed
    surfaces there as an error, not as silently wrong numbers.

    Args:
        comm: a communicator of its own (a Dup), used only for the check.
        every_call: compare before every call (META_DIST_CHECK=1) or only in ``settle``.
    """

    def __init__(self, comm: MPI.Comm, every_call: bool = True) -> None:
        self.comm, self.every_call = comm, every_call
        # call key -> (the pair (h, -h) as bytes: what is sent and what comes back if all
        # agree, and h)
        self._pairs: dict[tuple, tuple[bytes, int]] = {}
        self._running = 0  # the calls since the last settle, folded (every_call off)
        self._pair = np.empty(2, np.int64)
        self._sent = memoryview(self._pair).cast("B")
        self._result = np.empty(2, np.int64)
        self._received = memoryview(self._result).cast("B")
        # A persistent allreduce (MPI-4) on these buffers costs less per check than
        # MPI_Allreduce (`bench collectives --check-cost`). Collective to make.
        self._request: MPI.Prequest | None = None
        if hasattr(comm, "Allreduce_init"):
            with contextlib.suppress(NotImplementedError, MPI.Exception):
                self._request = comm.Allreduce_init(self._pair, self._result, op=MPI.MAX)

    def verify(self, api: str, arrays: list[Any], dtypes: Sequence[np.dtype],
               op: str, root: int) -> None:
        """Raise ValueError on every rank if the ranks called different collectives or shapes.

        Collective: every rank calls it with its own arguments (or ``refuse``).
        """
        first = arrays[0] if arrays else NO_ARRAYS
        shapes = (first.shape,) if len(arrays) == 1 else tuple([a.shape for a in arrays])
        key = (api, op, root, first.dtype.char, type(first), shapes)
        found = self._pairs.get(key)
        if found is None:
            if len(self._pairs) > 4096:  # shapes that vary every call: keep the cache bounded
                self._pairs.clear()
            code = shape_code([(KINDS.index(api), len(op) and ord(op[0]) * 256 + ord(op[-1]),
                                root, dtypes.index(first.dtype), int(is_cupy_array(first)))]
                              + list(shapes))
            found = self._pairs[key] = (np.array([code, -code], np.int64).tobytes(), code)
        pair, code = found
        if not self.every_call:
            self._running = (self._running * 1099511628211 + code + 1) % (1 << 62)
        elif not self._agrees(pair):  # max(h) == h and min(h) == h: every rank agrees
            self._mismatch(api, _call(api, arrays, op, root))

    def settle(self) -> None:
        """Raise ValueError on every rank if the calls since the last settle differed.

        Collective. Nothing to do when every call is compared as it is made.
        """
        if self.every_call:
            return
        code, self._running = self._running, 0
        if not self._agrees(np.array([code, -code], np.int64).tobytes()):
            raise ValueError(
                "collectives: the ranks' calls since the last comparison differed (in "
                "collective, op, root, dtype or shapes), so their results are not to be "
                "trusted; META_DIST_CHECK=0 compares calls only at barriers, epoch ends and "
                "close: run with META_DIST_CHECK=1 to see which call and which ranks differ")

    def refuse(self, api: str, reason: str) -> None:
        """Meet the peers in the check of this call and make it fail there, naming ``reason``.

        For a rank whose own arguments were refused before the check (a read-only output on
        this rank only, say): its peers raise at once instead of waiting for it. The caller
        raises its own error afterwards. Collective, in the place of ``verify``.
        """
        self._agrees(REFUSED_PAIR)
        self.comm.allgather({"refused": f"{api} ({reason})"})

    def _mismatch(self, api: str, call: dict[str, Any]) -> None:
        calls = self.comm.allgather(call)
        refused = [r for r, c in enumerate(calls) if "refused" in c]
        listing = "; ".join(f"rank {r}: " + (f"{REFUSED_MARK}{c['refused']}" if "refused" in c
                                             else c["described"]) for r, c in enumerate(calls))
        if refused:
            raise ValueError(
                f"{api}: rank {', '.join(map(str, refused))} refused its arguments, so every rank "
                f"abandons this call: {listing}; fix the arguments there")
        differ = [f for f in _FIELDS if len({repr(c[f]) for c in calls}) > 1]
        if "collective" in differ:  # the rest differs as a consequence; the listing shows it
            differ = ["collective"]
        fields = "; ".join(f"{f}: " + ", ".join(f"rank {r} {c[f]!r}" for r, c in enumerate(calls))
                           for f in differ)
        raise ValueError(
            f"{api}: the ranks' calls differ in {', '.join(differ)} ({fields}); the ranks passed "
            f"different arrays or called different collectives: {listing}; every rank must call "
            "the same collective with the same shapes, dtype, op and root")

    def _agrees(self, pair: bytes) -> bool:
        """Allreduce (max) this rank's pair with every rank's; return whether it came back."""
        self._sent[:] = pair
        if self._request is not None:
            self._request.Start()
            self._request.Wait()
        else:
            self.comm.Allreduce(self._pair, self._result, op=MPI.MAX)
        return self._received == pair

    def close(self) -> None:
        """Release the persistent request (before its communicator is freed)."""
        if self._request is not None:
            self._request.Free()
            self._request = None


_FIELDS = ("collective", "op", "root", "dtype", "size", "shapes", "arrays")


def _call(api: str, arrays: list[Any], op: str, root: int) -> dict[str, Any]:
    """Describe one rank's call field by field, for the message that names what differs."""
    if not arrays:
        return {"collective": api, "op": None, "root": None, "dtype": None, "size": 0,
                "shapes": [], "arrays": None, "described": api}
    kind = "cupy " if is_cupy_array(arrays[0]) else ""
    shown = ", ".join(f"{kind}{a.dtype} {tuple(a.shape)}" for a in arrays)
    return {"collective": api, "op": op or None, "root": root if root >= 0 else None,
            "dtype": str(arrays[0].dtype), "size": sum(int(a.size) for a in arrays),
            "shapes": [tuple(a.shape) for a in arrays],
            "arrays": "cupy arrays" if kind else "numpy arrays", "described": f"{api} of {shown}"}


def agree_settings(connector: Any, owner: str, settings: dict[str, Any]) -> None:
    """Raise ValueError on every rank unless every rank has these settings. Collective.

    Each one decides which calls a collective makes (the check's extra allreduce, where the
    pairwise exchange starts): a rank with other values would leave its peers waiting.
    """
    if connector.size == 1:
        return
    every = connector.allgather(settings)
    differ = [k for k in settings if any(s[k] != settings[k] for s in every)]
    if differ:
        listing = "; ".join(f"rank {r}: " + ", ".join(f"{k}={s[k]!r}" for k in differ)
                            for r, s in enumerate(every))
        raise ValueError(
            f"{owner}: settings differ across ranks: {listing}; expected the same values on "
            "every rank (set META_DIST_CHECK, META_DIST_CUDA_AWARE_MPI, "
            "mpi4py.rc.thread_level and the communicator's arguments alike everywhere)")


def advised(run: Callable[[], Any], api: str) -> Callable[[], Any]:
    """Wrap ``run`` so that an MPI failure says what the per-call check would have shown."""

    def run_advised() -> Any:
        try:
            return run()
        except MPI.Exception as error:
            raise RuntimeError(
                f"{api}: the MPI library failed: {error.Get_error_string().strip()}; with "
                "META_DIST_CHECK=0 the ranks' calls are not compared before they run, and ranks "
                "that pass arrays of different sizes or dtypes (or, in MPICH, a floating max or "
                "min against another op) fail like this: run with META_DIST_CHECK=1 to see "
                "which ranks differ") from error

    return run_advised
