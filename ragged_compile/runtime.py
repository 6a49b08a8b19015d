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
every match is also checked against the tensor's values.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .backends import flashinfer as fi
from .reference import reference_attention
from .validation import check_cu_seqlens_values, debug_checks

__all__ = ["Runtime", "Layout", "get_runtime", "current_step"]

log = logging.getLogger("ragged_compile")

_WORKSPACE_BYTES = 256 << 20
_WRAPPERS_PER_CONFIG = 8  # beyond this a step waits for an old plan's copy to land
_RETAINED_STEPS = 2  # finished training steps kept for activation-checkpoint recomputes
_ids = itertools.count()


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
        return (cu.data_ptr(), cu._version, cu.numel(), cu.dtype)

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
            self.runtime.stats["syncs"] += 1
        elif hit is None:
            hit = self.host[key] = cu.to("cpu", torch.int32)
            self.held.append(cu)
            self.runtime.stats["syncs"] += 1
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

    def attention(self, q, k, v, cu_q, cu_k, causal: bool, scale: float) -> torch.Tensor:
        rt = self.runtime
        reason = rt._unsupported(q)
        if reason is not None:
            rt._warn_once(reason)
            rt.stats["reference"] += 1
            rt.last_backend = "reference"
            return reference_attention(q, k, v, cu_q, cu_k, causal, scale)
        total_q, total_k = q.shape[0], k.shape[0]
        layout = self.layout_for(cu_q, cu_k, total_q, total_k)
        if debug_checks():
            dq, dk = layout.device_offsets(q.device)
            if not (torch.equal(dq, cu_q.to(dq.dtype)) and torch.equal(dk, cu_k.to(dk.dtype))):
                raise ValueError("cu_seqlens do not match the layout planned for this step")
        if total_q == 0:
            return q.new_empty(q.shape)
        if total_k == 0:
            return q.new_zeros(q.shape)
        slot = rt._plan(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale)
        rt.stats["flashinfer"] += 1
        return fi.run(slot.wrapper, q, k, v)

    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal: bool, scale: float):
        """:meth:`attention` for training: also the LSE in the backward's layout
        (``[Hq, Tq]`` fp32, natural log, ``+inf`` for keyless rows; see
        backends/flash_backward.py) and the longest q and k segment from the host
        layout, so the backward needs no sync. The caller checked support."""
        from .backends.flash_backward import lse_from_flashinfer

        rt = self.runtime
        self.trains = True  # kept past its end for checkpoint recomputes (Runtime._retain)
        total_q, total_k = q.shape[0], k.shape[0]
        layout = self.layout_for(cu_q, cu_k, total_q, total_k)
        if debug_checks():
            dq, dk = layout.device_offsets(q.device)
            if not (torch.equal(dq, cu_q.to(dq.dtype)) and torch.equal(dk, cu_k.to(dk.dtype))):
                raise ValueError("cu_seqlens do not match the layout planned for this step")
        max_lens = layout.__dict__.get("max_lens")
        if max_lens is None:
            max_lens = layout.max_lens = tuple(
                int((cu[1:] - cu[:-1]).max()) if layout.n else 0 for cu in (layout.cu_q, layout.cu_k)
            )
        if total_q == 0 or total_k == 0:
            lse = torch.full((q.shape[1], total_q), float("inf"), dtype=torch.float32, device=q.device)
            return q.new_zeros(q.shape), lse, max_lens
        slot = rt._plan(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale)
        rt.stats["flashinfer"] += 1
        out, lse = fi.run_with_lse(slot.wrapper, q, k, v)
        return out, lse_from_flashinfer(lse), max_lens


_local = threading.local()


@contextmanager
def _activate(step):
    """Make `step` the one the op's CUDA kernel sees on this thread."""
    stack = _local.__dict__.setdefault("steps", [])
    stack.append(step)
    try:
        yield step
    finally:
        stack.pop()


def current_step() -> _Step | None:
    stack = getattr(_local, "steps", None)
    return stack[-1] if stack else None


class Runtime:
    """Owns FlashInfer wrappers and workspaces for one CUDA device.

    Args:
        device: the CUDA device (default: the current one).
        backend: ``"auto"`` (fa3 on SM90 for long segments, fa2 otherwise),
            ``"fa2"`` or ``"fa3"``; default from ``RAGGED_COMPILE_BACKEND``, else auto.
        workspace_bytes: FlashInfer float workspace, shared by this runtime's
            wrappers (they run one after another on the stream).

    ``stats`` counts ``plans``, ``syncs`` (device-to-host reads of offsets),
    ``waits`` (a plan that had to wait for an earlier plan's copy),
    ``flashinfer`` and ``reference`` calls.
    """

    def __init__(self, device=None, *, backend: str | None = None, workspace_bytes: int = _WORKSPACE_BYTES):
        if backend is None:
            backend = os.environ.get("RAGGED_COMPILE_BACKEND", "auto")
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"backend must be 'auto', 'fa2' or 'fa3', got {backend!r}")
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend
        self.workspace_bytes = workspace_bytes
        self.stats: Counter = Counter()
        self._workspace: torch.Tensor | None = None
        self._pool: dict[tuple, list[_Slot]] = {}
        self._tick = 0
        self._warned: set[str] = set()
        self.last_backend: str | None = None  # what the last call ran: "fa2", "fa3", "reference"

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
            with _activate(step):
                yield step
        finally:
            for slot in step.slots:
                slot.last_used = self._tick
            self._tick += 1
            if getattr(step, "trains", False):
                self._retain(step)

    def graphed(self, model, buckets, *, split_kv="auto"):
        """Run ``model(x, cu_seqlens[, kv, cu_seqlens_k])`` under CUDA graphs,
        one capture per bucket, re-planned before every replay: see cudagraph.py.
        ``split_kv`` ("auto", True or False) decides whether fa2 may split long
        k/v segments in graph mode; "auto" allows it for buckets of long segments."""
        from .cudagraph import GraphedModel

        return GraphedModel(model, buckets, runtime=self, split_kv=split_kv)

    # -- the op's CUDA kernel ------------------------------------------------
    def attention(self, q, k, v, cu_q, cu_k, causal: bool, scale: float) -> torch.Tensor:
        step = current_step()
        if step is None or step.runtime is not self:
            with self.step():
                return self.attention(q, k, v, cu_q, cu_k, causal, scale)
        return step.attention(q, k, v, cu_q, cu_k, causal, scale)

    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal: bool, scale: float):
        """The training forward's kernel: see :meth:`_Step.attention_with_lse`.

        Outside a step (an activation-checkpoint recompute runs in the backward,
        after the forward's step closed, on autograd's device thread), a call on
        offsets a recent training step identified runs in that step again: its
        layout and plans, no second plan and no sync.
        """
        step = current_step()
        if step is None or step.runtime is not self:
            step = self._retained_step(cu_q, cu_k)
            if step is None:
                with self.step():
                    return self.attention_with_lse(q, k, v, cu_q, cu_k, causal, scale)
        return step.attention_with_lse(q, k, v, cu_q, cu_k, causal, scale)

    def _retain(self, step: _Step) -> None:
        """Keep a finished training step (its offsets, layouts, plans and wrappers)
        for recomputes in its backward; the last _RETAINED_STEPS are kept."""
        retained = self.__dict__.setdefault("_retained", [])
        retained.append(step)
        del retained[:-_RETAINED_STEPS]

    def _retained_step(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> _Step | None:
        # The step holds these offsets: their (pointer, version) cannot name
        # other offsets while it is kept.
        key = (_Step._key(cu_q), _Step._key(cu_k))
        for step in reversed(self.__dict__.get("_retained", ())):
            if key in step.by_tensor:
                return step
        return None

    # -- planning -------------------------------------------------------------
    def _plan(self, step: _Step, layout: Layout, hq, hkv, d, dtype, causal, scale) -> _Slot:
        backend = fi.choose_backend(self.backend, self.device, layout.n, layout.total_k)
        self.last_backend = backend
        key = (layout.id, hq, hkv, d, dtype, causal, scale, backend)
        hit = step.plans.get(key)
        if hit is not None:
            return hit[0]
        slot = self._acquire(step, (backend, hq, hkv, fi.padded_head_dim(d), dtype, causal))
        fi.plan(slot.wrapper, layout.cu_q, layout.cu_k, hq, hkv, d, dtype, causal, scale)
        slot.event = torch.cuda.Event()
        slot.event.record()
        self.stats["plans"] += 1
        step.plans[key] = (slot, layout)
        return slot

    def _acquire(self, step: _Step, config: tuple) -> _Slot:
        """A wrapper of this config not used in this step, whose last plan's copy
        has landed: FlashInfer stages the plan in a pinned buffer per wrapper, and
        re-planning while that copy is in flight would corrupt it."""
        pool = self._pool.setdefault(config, [])
        kept = [s for r in self.__dict__.get("_retained", ()) if r is not step for s in r.slots]
        free = sorted((s for s in pool if s not in step.slots and s not in kept), key=lambda s: s.last_used)
        if not free and kept and len(pool) >= _WRAPPERS_PER_CONFIG:
            self._retained = []  # out of wrappers: retained training steps give theirs up
            return self._acquire(step, config)
        slot = next((s for s in free if s.event is None or s.event.query()), None)
        if slot is None and len(pool) < _WRAPPERS_PER_CONFIG:
            slot = _Slot(fi.make_wrapper(self._get_workspace(), config[0]))
            pool.append(slot)
        if slot is None:
            if not free:
                raise RuntimeError(
                    f"more than {_WRAPPERS_PER_CONFIG} layouts of one configuration in one step"
                )
            slot = free[0]
            self.stats["waits"] += 1
            slot.event.synchronize()
        step.slots.append(slot)
        return slot

    def _get_workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _unsupported(self, q: torch.Tensor) -> str | None:
        dtype, head_dim = q.dtype, q.shape[-1]
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


_runtimes: dict[torch.device, Runtime] = {}


def get_runtime(device: torch.device) -> Runtime:
    """The runtime of the innermost active step on `device`, else that device's default."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    step = current_step()
    if step is not None and step.runtime.device == device:
        return step.runtime
    if device not in _runtimes:
        _runtimes[device] = Runtime(device)
    return _runtimes[device]
