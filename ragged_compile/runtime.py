"""The runtime manager: owns FlashInfer wrappers and workspaces, and plans
outside the compiled region, once per layout per forward.

How the op's CUDA kernel finds its plan with no host work on the hot path:

* A *step* (``with runtime.step(...)``) spans one forward. ``ragged_compile.compile``
  opens one around every call of the compiled model, outside the compiled region.
* Within a step, a layout is known either from host lengths given to ``step()``
  (no device-to-host sync at all) or, the first time a ``cu_seqlens`` tensor is
  seen, by copying it to the host once (one sync per distinct layout per step).
* Plans are cached per (layout, heads, head dim, dtype, causal, scale, backend)
  for the step, so a 24-layer model plans once, not 24 times.
* The step holds a reference to every ``cu_seqlens`` tensor it has identified,
  keyed by (data pointer, version counter): the memory cannot be reused for
  other offsets while the step lives, and in-place edits bump the version. A
  plan therefore never outlives its step, and a new step never sees an old plan:
  two forwards with equal totals and different layouts each get their own.

Matching a tensor against lengths given to ``step()`` is by (segments, q tokens,
k tokens) alone; where two declared layouts share those, the kernel falls back
to reading the offsets (counted as a sync). Under ``RAGGED_COMPILE_DEBUG=1``
every match is also checked against the tensor's values. Inference tensors
(made under ``torch.inference_mode()``) track no version: within one step their
offsets must not be edited in place.

Without a step (eager code under :func:`ragged_compile.enable`), each thread
keeps an *implicit step* per runtime: a plan is reused while the very offsets
tensors it was made from are alive and unmodified (:class:`OffsetsCache`: object
identity through a weak reference, so a freed tensor whose id or memory is
reused never matches, plus the in-place version). An eager 8-layer forward over
one NJT therefore plans and syncs once, not 8 times. The implicit step is
replaced (its wrappers returned to the pool) once none of its offsets are alive
and unmodified, or after ``_IMPLICIT_LAYOUTS`` layouts. Inference tensors cannot
be checked for edits, so they get no reuse: one plan per call, said once at
WARNING.

Wrappers are owned by one step at a time (explicit or implicit, any thread);
the pool is locked. This module imports cudagraph.py (for :meth:`Runtime.graphed`);
cudagraph.py never imports this one: it uses the runtime it is given through
:meth:`Runtime.workspace`, :meth:`Runtime.unsupported_reason` and
:meth:`Runtime.step`, and the step stack of steps.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import warnings
import weakref
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .backends import flashinfer as fi
from .cudagraph import GraphedModel
from .reference import reference_attention
from .steps import activate, current_step
from .validation import check_cu_seqlens_values, debug_checks

__all__ = ["Runtime", "Layout", "OffsetsCache", "get_runtime", "current_step"]

log = logging.getLogger("ragged_compile")

_WORKSPACE_BYTES = 256 << 20
_WRAPPERS_PER_CONFIG = 8  # beyond this a step waits for an old plan's copy to land
_IMPLICIT_LAYOUTS = 4  # layouts an implicit step keeps planned (wrappers it holds per config)
_RETAINED_STEPS = 2  # finished training steps kept for activation-checkpoint recomputes
_ids = itertools.count()


def tensor_version(t: torch.Tensor) -> int | None:
    """The in-place version counter of ``t``; None for inference tensors, which keep none."""
    return None if t.is_inference() else t._version


class OffsetsCache:
    """Values computed from offsets tensors, valid while those very tensors are
    alive and unmodified.

    A hit needs the same tensor objects, checked through weak references (a
    freed tensor whose ``id`` or memory is reused by new offsets never matches),
    at the same in-place version (``cu.copy_(...)``, ``cu[1] = ...`` on it or on
    any view miss). Inference tensors keep no version, so they are never stored
    (``put`` returns False). At most ``capacity`` entries, least recently used
    dropped first. Not thread-safe: keep one per thread.
    """

    def __init__(self, capacity: int = _IMPLICIT_LAYOUTS):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()

    @staticmethod
    def _valid(entry, tensors) -> bool:
        refs, versions, _ = entry
        return all(r() is t for r, t in zip(refs, tensors)) and versions == tuple(
            tensor_version(t) for t in tensors
        )

    def get(self, tensors: tuple[torch.Tensor, ...]):
        key = tuple(map(id, tensors))
        entry = self._entries.get(key)
        if entry is None:
            return None
        if not self._valid(entry, tensors):
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[2]

    def put(self, tensors: tuple[torch.Tensor, ...], value) -> bool:
        versions = tuple(tensor_version(t) for t in tensors)
        if None in versions:
            return False
        self.prune()
        while len(self._entries) >= self.capacity:
            self._entries.popitem(last=False)
        self._entries[tuple(map(id, tensors))] = (tuple(weakref.ref(t) for t in tensors), versions, value)
        return True

    def prune(self) -> None:
        """Drop entries whose tensors were freed or edited in place."""
        for key, entry in list(self._entries.items()):
            tensors = tuple(r() for r in entry[0])
            if any(t is None for t in tensors) or not self._valid(entry, tensors):
                del self._entries[key]

    def __len__(self) -> int:
        self.prune()
        return len(self._entries)


def _as_offsets(lengths) -> torch.Tensor:
    lens = torch.as_tensor(lengths, dtype=torch.int64, device="cpu").flatten()
    if bool((lens < 0).any()):
        raise ValueError(f"segment lengths must be >= 0, got {lens.tolist()}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu[1:])
    return cu


@dataclass
class Layout:
    """One segment layout, as host offsets (int32)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        self.n = self.cu_q.numel() - 1
        self.total_q = int(self.cu_q[-1])
        self.total_k = int(self.cu_k[-1])
        # the training backward's grid sizes, read here so it never syncs
        self.max_lens = tuple(int((cu[1:] - cu[:-1]).max()) if self.n else 0 for cu in (self.cu_q, self.cu_k))
        self._device_cu: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_lengths(cls, seq_lens_q, seq_lens_k=None) -> Layout:
        cu_q = _as_offsets(seq_lens_q)
        cu_k = cu_q if seq_lens_k is None else _as_offsets(seq_lens_k)
        if cu_k.numel() != cu_q.numel():
            raise ValueError(
                f"seq_lens_q has {cu_q.numel() - 1} segments but seq_lens_k has "
                f"{cu_k.numel() - 1}; pair each q segment with one k/v segment"
            )
        return cls(cu_q, cu_k)

    def device_offsets(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._device_cu:
            self._device_cu[device] = (
                self.cu_q.to(device, non_blocking=True),
                self.cu_k.to(device, non_blocking=True),
            )
        return self._device_cu[device]


class _Slot:
    """A wrapper plus the event that marks its last plan's host-to-device copy."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.event: torch.cuda.Event | None = None
        self.last_used = 0
        self.owner: weakref.ref | None = None  # the step planning it; free once that is gone

    def free(self) -> bool:
        return self.owner is None or self.owner() is None


class _Step:
    def __init__(self, runtime: Runtime, declared: list[Layout]):
        self.runtime = runtime
        self.declared = declared
        self.by_tensor: dict[tuple, Layout] = {}
        self.host: dict[tuple, torch.Tensor | tuple] = {}  # offsets read (or being read) to the host
        self.held: list[torch.Tensor] = []  # keeps identified offsets' memory from reuse
        self.plans: dict[tuple, tuple[_Slot, Layout]] = {}
        self.slots: list[_Slot] = []

    @staticmethod
    def _key(cu: torch.Tensor) -> tuple:
        # The step holds every tensor it identified, so the address is not reused
        # while the step lives; the version catches in-place edits.
        return (cu.data_ptr(), tensor_version(cu), cu.numel(), cu.dtype)

    def prefetch(self, cu: torch.Tensor) -> None:
        """Start copying device offsets to the host now, without waiting.

        The first attention layer then waits only for this copy, which the GPU
        reaches before the layer's own inputs, instead of draining the queue.
        """
        if cu.device.type != "cuda" or self._key(cu) in self.host:
            return
        host = torch.empty(cu.shape, dtype=cu.dtype, pin_memory=True)
        host.copy_(cu, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.host[self._key(cu)] = (host, event)
        self.held.append(cu)

    def _host(self, cu: torch.Tensor) -> torch.Tensor:
        """Host copy of offsets: one device-to-host read per tensor per step."""
        key = self._key(cu)
        hit = self.host.get(key)
        if isinstance(hit, tuple):  # prefetched: wait for that copy only
            host, event = hit
            event.synchronize()
            hit = self.host[key] = host.to(torch.int32)
            self.runtime._count("syncs")
        elif hit is None:
            hit = self.host[key] = cu.to("cpu", torch.int32)
            self.held.append(cu)
            self.runtime._count("syncs")
        return hit

    def layout_for(self, cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> Layout:
        key = (self._key(cu_q), self._key(cu_k))
        layout = self.by_tensor.get(key)
        if layout is not None:
            return layout
        n = cu_q.numel() - 1
        matches = [
            lay
            for lay in self.declared
            if lay.n == n and lay.total_q == total_q and lay.total_k == total_k
        ]
        if len(matches) == 1 and not debug_checks():
            layout = matches[0]
            self.held += [cu_q, cu_k]
        else:
            # Read the offsets; validated here because this is host work anyway.
            host_q, host_k = self._host(cu_q), self._host(cu_k)
            check_cu_seqlens_values(host_q, total_q, "cu_seqlens_q")
            check_cu_seqlens_values(host_k, total_k, "cu_seqlens_k")
            if len(matches) == 1 and not (
                torch.equal(matches[0].cu_q, host_q) and torch.equal(matches[0].cu_k, host_k)
            ):
                raise ValueError(
                    "the offsets the model passed do not match the lengths given to "
                    "Runtime.step(); pass the lengths of this forward's batch"
                )
            layout = matches[0] if len(matches) == 1 else Layout(host_q, host_k)
        self.by_tensor[key] = layout
        return layout

    def knows(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> bool:
        """Whether this step identified these offsets (it holds them, so their
        address and version cannot name other offsets while it lives)."""
        return (self._key(cu_q), self._key(cu_k)) in self.by_tensor

    def release(self, tick: int) -> None:
        """Give this step's wrappers back to the pool."""
        for slot in self.slots:
            slot.last_used = tick
            slot.owner = None
        self.slots = []

    def _checked_layout(self, q, k, cu_q, cu_k) -> Layout:
        layout = self.layout_for(cu_q, cu_k, q.shape[0], k.shape[0])
        if debug_checks():
            dq, dk = layout.device_offsets(q.device)
            if not (torch.equal(dq, cu_q.to(dq.dtype)) and torch.equal(dk, cu_k.to(dk.dtype))):
                raise ValueError("cu_seqlens do not match the layout planned for this step")
        return layout

    def attention(self, q, k, v, cu_q, cu_k, causal: bool, scale: float) -> torch.Tensor:
        rt = self.runtime
        reason = rt.unsupported_reason(q)
        if reason is not None:
            if q.device.type == "cuda":
                rt._warn_once(reason)
            rt._count("reference")
            rt.last_backend = "reference"
            return reference_attention(q, k, v, cu_q, cu_k, causal, scale)
        total_q, total_k = q.shape[0], k.shape[0]
        layout = self._checked_layout(q, k, cu_q, cu_k)
        if total_q == 0:
            return q.new_empty(q.shape)
        if total_k == 0:
            return q.new_zeros(q.shape)
        slot = rt._plan(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale)
        rt._count("flashinfer")
        return fi.run(slot.wrapper, q, k, v)

    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal: bool, scale: float):
        """:meth:`attention` for training: also the LSE in the backward's layout
        (``[Hq, Tq]`` fp32, natural log, ``+inf`` for keyless rows; see
        backends/flash_backward.py) and the longest q and k segment from the host
        layout, so the backward needs no sync. The caller checked support."""
        from .backends.flash_backward import lse_from_flashinfer

        rt = self.runtime
        self.trains = True  # kept past its end for checkpoint recomputes (Runtime._release)
        total_q, total_k = q.shape[0], k.shape[0]
        layout = self._checked_layout(q, k, cu_q, cu_k)
        max_lens = layout.max_lens
        if total_q == 0 or total_k == 0:
            lse = torch.full((q.shape[1], total_q), float("inf"), dtype=torch.float32, device=q.device)
            return q.new_zeros(q.shape), lse, max_lens
        slot = rt._plan(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale)
        rt._count("flashinfer")
        out, lse = fi.run_with_lse(slot.wrapper, q, k, v)
        return out, lse_from_flashinfer(lse), max_lens


class _ImplicitStep(_Step):
    """The step of calls made outside any ``Runtime.step`` on one thread: layouts
    are found through :class:`OffsetsCache`, and nothing is held alive."""

    def __init__(self, runtime: Runtime):
        super().__init__(runtime, [])
        self.layouts = OffsetsCache(_IMPLICIT_LAYOUTS)
        self.identified = 0  # layouts planned for (the wrappers it holds grow with it)
        self.reads = OffsetsCache(2 * _IMPLICIT_LAYOUTS)  # host copies, per tensor

    def knows(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> bool:
        return self.layouts.get((cu_q, cu_k)) is not None

    def spent(self) -> bool:
        """No layout of it is usable any more, or it holds as many as it may."""
        return self.identified >= _IMPLICIT_LAYOUTS or (self.identified > 0 and len(self.layouts) == 0)

    def _host(self, cu: torch.Tensor) -> torch.Tensor:
        host = self.reads.get((cu,))
        if host is None:
            host = cu.to("cpu", torch.int32, copy=True)  # never an alias of the user's tensor
            self.reads.put((cu,), host)
            self.runtime._count("syncs")
        return host

    def layout_for(self, cu_q, cu_k, total_q: int, total_k: int) -> Layout:
        layout = self.layouts.get((cu_q, cu_k))
        if layout is not None:
            return layout
        host_q, host_k = self._host(cu_q), self._host(cu_k)
        check_cu_seqlens_values(host_q, total_q, "cu_seqlens_q")
        check_cu_seqlens_values(host_k, total_k, "cu_seqlens_k")
        layout = Layout(host_q, host_k)
        self.layouts.put((cu_q, cu_k), layout)
        self.identified += 1
        return layout


class Runtime:
    """Owns FlashInfer wrappers and workspaces for one CUDA device.

    Args:
        device: the CUDA device (default: the current one), or ``"cpu"``. With
            no CUDA device, ``Runtime()`` is a CPU runtime: the op runs the
            reference kernel there, steps cost nothing and :meth:`graphed` runs
            its bookkeeping without capturing graphs, so the same code runs on
            both.
        backend: ``"auto"`` (per layout, fa2 or fa3 from a cost table measured
            on the H200: :func:`backends.flashinfer.choose_backend`), ``"fa2"``
            or ``"fa3"``; default from ``RAGGED_COMPILE_BACKEND``, else auto.
        workspace_bytes: FlashInfer float workspace per CUDA stream, shared by
            this runtime's wrappers on that stream (they run one after another).

    ``stats`` counts ``plans``, ``syncs`` (device-to-host reads of offsets),
    ``waits`` (a plan that had to wait for an earlier plan's copy),
    ``flashinfer`` and ``reference`` calls.

    One runtime may serve many threads: steps are per thread, and a wrapper is
    planned by one step at a time. Wrappers used on different CUDA streams get
    different float workspaces (``workspace_bytes`` each), so calls on two
    streams never share scratch memory.
    """

    def __init__(self, device=None, *, backend: str | None = None, workspace_bytes: int = _WORKSPACE_BYTES):
        if backend is None:
            backend = os.environ.get("RAGGED_COMPILE_BACKEND", "auto")
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"backend must be 'auto', 'fa2' or 'fa3', got {backend!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"Runtime(device={str(self.device)!r}): the runtime serves 'cuda' (FlashInfer) or "
                f"'cpu'; on other devices the op runs the reference kernel and needs no runtime"
            )
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"Runtime(device={str(self.device)!r}): this PyTorch has no usable CUDA device "
                    f"(torch.cuda.is_available() is False). Use Runtime('cpu') (or Runtime(), "
                    f"which picks CPU here): the CPU op runs the reference kernel and graphed() "
                    f"runs without capture; install a CUDA build of PyTorch for FlashInfer"
                )
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend
        self.workspace_bytes = workspace_bytes
        self.stats: Counter = Counter()
        # Float workspaces per CUDA stream: wrappers on two streams may run at once.
        self._workspaces: dict[int, torch.Tensor] = {}
        self._default_stream = (
            torch.cuda.default_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        )
        self._pool: dict[tuple, list[_Slot]] = {}
        self._tick = 0
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # the wrapper pool, the workspace, stats, the tick
        self._local = threading.local()  # this thread's implicit step
        self._retained: list[_Step] = []  # finished training steps (see _release)
        self.last_backend: str | None = None  # what the last call ran: "fa2", "fa3", "reference"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    # -- steps ---------------------------------------------------------------
    @contextmanager
    def step(self, seq_lens_q=None, seq_lens_k=None):
        """Scope one forward: plans made inside are reused by every layer.

        ``seq_lens_q`` / ``seq_lens_k``: host-side segment lengths (list or CPU
        tensor) of this forward's batch, if known; then finding the layout costs
        no device-to-host sync. With ``seq_lens_k`` the step knows the cross
        layout (q, k) and both self layouts (q, q) and (k, k).
        """
        declared = []
        if seq_lens_q is not None:
            lay = Layout.from_lengths(seq_lens_q, seq_lens_k)
            declared.append(lay)
            if seq_lens_k is not None:
                declared += [Layout(lay.cu_q, lay.cu_q), Layout(lay.cu_k, lay.cu_k)]
        step = _Step(self, declared)
        try:
            with activate(step):
                yield step
        finally:
            self._release(step)

    def _release(self, step: _Step) -> None:
        """End a step: its wrappers go back to the pool. A training step is kept,
        wrappers and all, for activation-checkpoint recomputes in its backward;
        the last _RETAINED_STEPS of them are."""
        with self._lock:
            done = [step]
            if getattr(step, "trains", False):
                self._retained.append(step)
                done = self._retained[:-_RETAINED_STEPS]
                del self._retained[:-_RETAINED_STEPS]
            for finished in done:
                finished.release(self._tick)
            self._tick += 1

    def graphed(self, model, buckets, *, split_kv="auto", outputs=None):
        """Run ``model(x, cu_seqlens[, kv, cu_seqlens_k])`` under CUDA graphs,
        one capture per bucket, re-planned before every replay: see cudagraph.py.

        ``split_kv`` ("auto", True or False) decides whether fa2 may split long
        k/v segments in graph mode; "auto" allows it for buckets of long segments.
        ``outputs`` says which rows of each output are real: ``"tokens"`` (one
        row per token: the real tokens' rows come back), ``"segments"`` (one row
        per segment, as pooled embeddings: the real segments' rows come back) or
        ``"whole"`` (returned as is); one string for every output tensor or a
        pytree of them shaped like the output. ``None`` decides by each output's
        first dimension (the bucket's token rows, or its segments + 1)."""
        return GraphedModel(model, buckets, runtime=self, split_kv=split_kv, outputs=outputs)

    # -- the op's CUDA kernel ------------------------------------------------
    def attention(self, q, k, v, cu_q, cu_k, causal: bool, scale: float) -> torch.Tensor:
        if q.device != self.device:
            raise ValueError(
                f"q is on {q.device} but this runtime serves {self.device}; use "
                f"rc.Runtime({str(q.device)!r}) for it"
            )
        if q.device.type != "cuda":
            self._count("reference")
            self.last_backend = "reference"
            return reference_attention(q, k, v, cu_q, cu_k, causal, scale)
        step = self._step_for(cu_q, cu_k)
        if step is None:  # offsets that cannot be checked for edits: a step per call
            with self.step():
                return self.attention(q, k, v, cu_q, cu_k, causal, scale)
        return step.attention(q, k, v, cu_q, cu_k, causal, scale)

    def _step_for(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> _Step | None:
        """The step a call with these offsets runs in: the thread's active step of
        this runtime, else its implicit step (renewed when stale or full), else
        None for inference-tensor offsets, whose edits cannot be seen."""
        step = current_step()
        if step is not None and step.runtime is self:
            return step
        if tensor_version(cu_q) is None or tensor_version(cu_k) is None:
            self._log_once(
                "offsets are inference tensors (made under torch.inference_mode()), which "
                "track no in-place edits, so ragged_compile cannot reuse a plan across layers "
                "and plans (and reads offsets) at every attention call; run the forward under "
                "torch.no_grad(), inside Runtime.step(), or through ragged_compile.compile"
            )
            return None
        implicit = getattr(self._local, "implicit", None)
        if implicit is not None and (implicit.knows(cu_q, cu_k) or not implicit.spent()):
            return implicit
        if implicit is not None:
            self._release(implicit)
        implicit = self._local.implicit = _ImplicitStep(self)
        return implicit

    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal: bool, scale: float):
        """The training forward's kernel: see :meth:`_Step.attention_with_lse`.

        Outside a step (an activation-checkpoint recompute runs in the backward,
        after the forward's step closed, on autograd's device thread), a call on
        offsets a recent training step identified runs in that step again: its
        layout and plans, no second plan and no sync.
        """
        step = current_step()
        if step is None or step.runtime is not self:
            step = self._retained_step(cu_q, cu_k) or self._step_for(cu_q, cu_k)
            if step is None:
                with self.step():
                    return self.attention_with_lse(q, k, v, cu_q, cu_k, causal, scale)
        return step.attention_with_lse(q, k, v, cu_q, cu_k, causal, scale)

    def _retained_step(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> _Step | None:
        with self._lock:
            retained = list(self._retained)
        for step in reversed(retained):
            if step.knows(cu_q, cu_k):
                return step
        return None

    # -- planning -------------------------------------------------------------
    def _current_stream(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.current_stream(self.device).cuda_stream

    def _plan(self, step: _Step, layout: Layout, hq, hkv, d, dtype, causal, scale) -> _Slot:
        backend = fi.choose_backend(
            self.backend, self.device, layout.n, layout.total_k,
            hq=hq, hkv=hkv, head_dim=d, causal=causal,
        )
        self.last_backend = backend
        # The stream is part of the key: a plan's copy is ordered on the stream it
        # was made on, and each stream has its own workspace.
        stream = self._current_stream()
        key = (layout.id, hq, hkv, d, dtype, causal, scale, backend, stream)
        hit = step.plans.get(key)
        if hit is not None:
            return hit[0]
        slot = self._acquire(step, (backend, hq, hkv, fi.padded_head_dim(d), dtype, causal, stream))
        fi.plan(slot.wrapper, layout.cu_q, layout.cu_k, hq, hkv, d, dtype, causal, scale)
        slot.event = torch.cuda.Event()
        slot.event.record()
        self._count("plans")
        step.plans[key] = (slot, layout)
        return slot

    def _acquire(self, step: _Step, config: tuple) -> _Slot:
        """A wrapper of this config that no live step holds, whose last plan's
        copy has landed: FlashInfer stages the plan in a pinned buffer per
        wrapper, and re-planning while that copy is in flight would corrupt it."""
        with self._lock:
            pool = self._pool.setdefault(config, [])
            mine = sum(1 for s in step.slots if s in pool)
            if mine >= _WRAPPERS_PER_CONFIG:
                raise RuntimeError(
                    f"more than {_WRAPPERS_PER_CONFIG} layouts of one configuration in one step"
                )
            free = sorted((s for s in pool if s.free()), key=lambda s: s.last_used)
            while not free and len(pool) >= _WRAPPERS_PER_CONFIG and self._retained:
                # Out of wrappers: the oldest retained training step gives its up
                # (a recompute on its offsets then plans again).
                self._retained.pop(0).release(self._tick)
                free = sorted((s for s in pool if s.free()), key=lambda s: s.last_used)
            slot = next((s for s in free if s.event is None or s.event.query()), None)
            # Past the soft limit only when every wrapper is held (other threads' steps).
            if slot is None and (len(pool) < _WRAPPERS_PER_CONFIG or not free):
                slot = _Slot(fi.make_wrapper(self._workspace_locked(config[-1]), config[0]))
                pool.append(slot)
            wait = slot is None
            if wait:
                slot = free[0]
                self.stats["waits"] += 1
            slot.owner = weakref.ref(step)
            step.slots.append(slot)
        if wait:
            slot.event.synchronize()
        return slot

    def workspace(self, stream: int | None = None) -> torch.Tensor:
        """FlashInfer's float workspace for wrappers that run on ``stream`` (a
        ``cuda_stream`` handle; default: the device's default stream, whose
        workspace CUDA-graph mode shares). Allocated on first use."""
        with self._lock:
            return self._workspace_locked(stream)

    def _workspace_locked(self, stream: int | None = None) -> torch.Tensor:
        stream = self._default_stream if stream is None else stream
        ws = self._workspaces.get(stream)
        if ws is None:
            ws = self._workspaces[stream] = torch.empty(
                self.workspace_bytes, dtype=torch.uint8, device=self.device
            )
        return ws

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        """Why this runtime would run the reference kernel for ``q``, or None for FlashInfer."""
        dtype, head_dim = q.dtype, q.shape[-1]
        if q.device.type != "cuda":
            return "not a CUDA tensor: the reference kernel runs"
        if not fi.available():
            return "flashinfer is not importable: CUDA ragged attention runs the reference kernel"
        if dtype not in fi.DTYPES:
            return (
                f"FlashInfer takes float16/bfloat16, got {dtype}: running the (slow, exact) "
                f"reference kernel; cast q/k/v to bfloat16 for FlashInfer speed"
            )
        if fi.padded_head_dim(head_dim) is None:
            return (
                f"head_dim {head_dim} > 256 is beyond FlashInfer: running the (slow, exact) "
                f"reference kernel"
            )
        return None

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            warnings.warn(msg, stacklevel=3)

    def _log_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning("ragged_compile: %s", msg)


_runtimes: dict[torch.device, Runtime] = {}
_runtimes_lock = threading.Lock()


def get_runtime(device: torch.device) -> Runtime:
    """The runtime of the innermost active step on `device`, else that device's default."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    step = current_step()
    if step is not None and step.runtime.device == device:
        return step.runtime
    with _runtimes_lock:
        if device not in _runtimes:
            _runtimes[device] = Runtime(device)
        return _runtimes[device]
