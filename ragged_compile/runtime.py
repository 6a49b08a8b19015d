"""The runtime: owns FlashInfer wrappers and workspaces for one device, and plans
outside the compiled region, once per layout per forward.

What a step is, and how the op's CUDA kernels find a plan with no host work on
the hot path, is steps.py. This module keeps the wrapper pool the steps plan
into: wrappers are owned by one step at a time (explicit or implicit, any
thread), and the pool is locked. The implicit step of eager code is replaced
(its wrappers returned to the pool) once none of its offsets are alive and
unmodified, or after ``steps.IMPLICIT_LAYOUTS`` layouts. Inference tensors
cannot be checked for edits, so they get no reuse: one plan per call, said once
at WARNING.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from contextlib import contextmanager

import torch

from . import config
from .backends import flashinfer as fi
from .backends import fa4_backward, select
from .backends.cpu import cpu_attention
from .reference import reference_attention
from .logs import warn_once
from .steps import (
    IMPLICIT_LAYOUTS, HostLayout, ImplicitStep, OffsetsCache, PlannedStep, Step, activate, current_step, tensor_version,
)
from .validation import debug_checks

__all__ = ["Runtime", "get_runtime"]

_WORKSPACE_BYTES = 256 << 20
_WRAPPERS_PER_CONFIG = 8  # beyond this a step waits for an old plan's copy to land
_RETAINED_STEPS = 2  # finished training steps kept for activation-checkpoint recomputes


class _Slot:
    """A wrapper plus the event that marks its last plan's host-to-device copy."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.event: torch.cuda.Event | None = None
        self.last_used = 0
        self.owner: weakref.ref | None = None  # the step planning it; free once that is gone

    def free(self) -> bool:
        return self.owner is None or self.owner() is None


class Runtime:
    """Owns FlashInfer wrappers and workspaces for one CUDA device.

    Args:
        device: the CUDA device (default: the current one), or ``"cpu"``. With
            no CUDA device, ``Runtime()`` is a CPU runtime: the op runs its CPU
            kernel there (which needs no plan), steps cost nothing and
            :meth:`graphed` runs its bookkeeping without capturing graphs, so
            the same code runs on both.
        backend: ``"auto"`` (per layout, from cost tables measured on the
            H200: :func:`backends.select.cuda_backend`: PyTorch's
            FlashAttention-2 varlen kernel, which needs no plan, where a plan
            would cost more host time than FlashInfer saves, as on small
            batches; else FlashInfer's fa2 or fa3), ``"fa2"`` or ``"fa3"``
            (always FlashInfer), ``"varlen"`` (FlashAttention-2 wherever it
            runs), ``"fa4"`` (training forwards on flash-attn-4 wherever it
            runs, :func:`backends.select.training_forward`; everything else as
            auto); default from ``RAGGED_COMPILE_BACKEND``, else auto.
        workspace_bytes: FlashInfer float workspace per CUDA stream, shared by
            this runtime's wrappers on that stream (they run one after another).

    ``stats`` counts ``plans``, ``syncs`` (device-to-host reads of offsets),
    ``waits`` (a plan that had to wait for an earlier plan's copy),
    ``flashinfer``, ``varlen`` (PyTorch's FlashAttention-2 forward), ``fa2``
    (the same kernel for windows), ``fa4`` (flash-attn-4's training forward),
    ``reference`` and (a CPU runtime's) ``cpu`` calls.

    One runtime may serve many threads: steps are per thread, and a wrapper is
    planned by one step at a time. Wrappers used on different CUDA streams get
    different float workspaces (``workspace_bytes`` each), so calls on two
    streams never share scratch memory.
    """

    def __init__(self, device=None, *, backend: str | None = None, workspace_bytes: int = _WORKSPACE_BYTES):
        if backend is None:
            backend = config.choice(config.BACKEND, config.BACKENDS)
        if backend not in config.BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, config.BACKENDS))}, got {backend!r}")
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
                    f"which picks CPU here): the op runs its CPU kernel and graphed() runs "
                    f"without capture; install a CUDA build of PyTorch for FlashInfer"
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
        self._lock = threading.Lock()  # the wrapper pool, the workspace, stats, the tick
        self._local = threading.local()  # this thread's implicit step
        self._retained: list[Step] = []  # finished training steps (see _release)
        # what the last call ran: FlashInfer's "fa2" / "fa3", "varlen", "reference"; windows:
        # "fa2" (PyTorch's FlashAttention-2) or "window" (window_forward.py)
        self.last_backend: str | None = None

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``stats[name]`` (under the runtime's lock: steps on many threads count)."""
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
            lay = HostLayout.from_lengths(seq_lens_q, seq_lens_k)
            declared.append(lay)
            if seq_lens_k is not None:
                declared += [HostLayout(lay.cu_q, lay.cu_q), HostLayout(lay.cu_k, lay.cu_k)]
        with self.run_step(PlannedStep(self, declared)) as step:
            yield step

    @contextmanager
    def run_step(self, step: PlannedStep):
        """Scope one forward in ``step``, a :class:`~ragged_compile.steps.PlannedStep`
        of this runtime made by the caller (a subclass that finds layouts its own
        way: hf_graphs.py): active on this thread inside, its wrappers given back
        at the end, as :meth:`step`."""
        if step.runtime is not self:
            raise ValueError("run_step takes a step of this runtime")
        try:
            with activate(step):
                yield step
        finally:
            self._release(step)

    def _release(self, step: Step) -> None:
        """End a step: its wrappers go back to the pool. A training step is kept,
        wrappers and all, for activation-checkpoint recomputes in its backward;
        the last _RETAINED_STEPS of them are."""
        with self._lock:
            done = [step]
            if step.trains:
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
        from .cudagraph import GraphedModel  # graph mode is optional: imported on use

        return GraphedModel(model, buckets, runtime=self, split_kv=split_kv, outputs=outputs)

    # -- host copies of device offsets -----------------------------------------
    def know_offsets(self, cu: torch.Tensor, host: torch.Tensor) -> None:
        """Tell this runtime, on this thread, the values of device offsets ``cu``
        (``host``: the same values on the CPU), so that a step meeting ``cu`` plans
        from ``host`` and reads nothing back. Kept while ``cu`` is alive and
        unmodified (identity and in-place version, as :class:`~ragged_compile.steps.OffsetsCache`);
        inference tensors, which keep no version, are not kept. Under
        ``RAGGED_COMPILE_DEBUG=1`` the values are checked against ``cu`` (a sync)."""
        host = host.to("cpu", torch.int32)
        if debug_checks() and not torch.equal(host, cu.to("cpu", torch.int32)):
            raise ValueError("know_offsets: host values differ from the device offsets they describe")
        known = self._local.__dict__.get("known")
        if known is None:
            known = self._local.known = OffsetsCache(2 * IMPLICIT_LAYOUTS)
        known.put((cu,), host)

    def known_offsets(self, cu: torch.Tensor) -> torch.Tensor | None:
        """The host values given to :meth:`know_offsets` for ``cu``, or None."""
        known = self._local.__dict__.get("known")
        return None if known is None else known.get((cu,))

    # -- the op's CUDA kernel ------------------------------------------------
    def attention(
        self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0
    ) -> torch.Tensor:
        if q.device != self.device:
            raise ValueError(
                f"q is on {q.device} but this runtime serves {self.device}; use "
                f"rc.Runtime({str(q.device)!r}) for it"
            )
        if q.device.type != "cuda":
            # A CPU runtime plans nothing: the op's CPU kernel (or, for float64, the reference) runs.
            variant = select.variant(causal, window, softcap)
            kernel = select.forward_kernel(q.device, q.dtype, q.shape[-1], variant)
            self.count(kernel)
            self.last_backend = kernel
            if kernel == "cpu":
                return cpu_attention(q, k, v, cu_q, cu_k, causal, scale, window_size=window)
            return reference_attention(q, k, v, cu_q, cu_k, causal, scale, window_size=window, softcap=softcap)
        step = self._step_for(cu_q, cu_k)
        if step is None:  # offsets that cannot be checked for edits: a step per call
            with self.step():
                return self.attention(q, k, v, cu_q, cu_k, causal, scale, window, softcap)
        return step.attention(q, k, v, cu_q, cu_k, causal, scale, window, softcap)

    def _step_for(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> Step | None:
        """The step a call with these offsets runs in: the thread's active step of
        this runtime, else its implicit step (renewed when stale or full), else
        None for inference-tensor offsets, whose edits cannot be seen."""
        step = current_step()
        if step is not None and step.runtime is self:
            return step
        if tensor_version(cu_q) is None or tensor_version(cu_k) is None:
            warn_once(
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
        implicit = self._local.implicit = ImplicitStep(self)
        return implicit

    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=(-1, -1),
                           trains: bool = True, softcap: float = 0.0):
        """The training forward's kernel: see :meth:`PlannedStep.attention_with_lse <ragged_compile.steps.PlannedStep.attention_with_lse>`.

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
                    return self.attention_with_lse(q, k, v, cu_q, cu_k, causal, scale, window, trains, softcap)
        return step.attention_with_lse(q, k, v, cu_q, cu_k, causal, scale, window, trains, softcap)

    def max_lens(self, q, k, cu_q, cu_k) -> tuple[int, int]:
        """The longest q and k segment of these offsets (for kernels that size their
        grid from them, as FlashAttention-2's), from the step's host layout: read
        once per layout, as planning does."""
        step = current_step()
        if step is None or step.runtime is not self:
            step = self._retained_step(cu_q, cu_k) or self._step_for(cu_q, cu_k)
            if step is None:
                with self.step():
                    return self.max_lens(q, k, cu_q, cu_k)
        return step.max_lens(q, k, cu_q, cu_k)

    def _retained_step(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> Step | None:
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
        # The raw handle, without making a Stream object: this runs on every call.
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def plan(
        self, step: PlannedStep, layout: HostLayout, hq, hkv, d, dtype, causal, scale, window_left: int = -1,
        softcap: float = 0.0, backend: str | None = None,
    ) -> _Slot:
        """The wrapper planned for ``layout`` in ``step``: found in the step's plans
        (every call after a layout's first), or planned now. ``window_left`` and
        ``softcap`` are FlashInfer plan arguments: a model alternating windowed and
        full layers keeps one plan of each per layout and forward. ``backend``:
        FlashInfer's family if the caller chose it (:meth:`kernel`)."""
        # The stream is part of the key: a plan's copy is ordered on the stream it
        # was made on, and each stream has its own workspace.
        stream = self._current_stream()
        key = (layout.id, hq, hkv, d, dtype, causal, scale, window_left, softcap, stream)
        hit = step.plans.get(key)
        if hit is not None:
            self.last_backend = hit[2]
            return hit[0]
        if backend is None:
            backend = select.flashinfer_backend(
                self.backend, self.device, max(layout.active, 1), layout.active_k,
                hq=hq, hkv=hkv, head_dim=d, causal=causal, pairs=layout.pairs,
            )
        self.last_backend = backend
        # a wrapper per variant too: a model alternating windowed and full layers plans
        # both per layout, each within its own configuration's limit
        config = (backend, hq, hkv, fi.flashinfer_head_dim(d), dtype, causal, window_left, softcap, stream)
        slot = self._acquire(step, config)
        fi.plan(slot.wrapper, layout.cu_q, layout.cu_k, hq, hkv, d, dtype, causal, scale,
                window_left=window_left, softcap=softcap)
        slot.event = torch.cuda.Event()
        slot.event.record()
        self.count("plans")
        step.plans[key] = (slot, layout, backend)
        return slot

    def kernel(
        self, step: PlannedStep, layout: HostLayout, hq: int, hkv: int, d: int, dtype: torch.dtype, causal: bool,
        trains: bool = False,
    ) -> str:
        """The kernel of a plain CUDA call on ``layout``: ``"varlen"`` (no plan),
        FlashInfer's ``"fa2"``/``"fa3"`` (:func:`backends.select.cuda_backend`), or
        for a training call ``"fa4"`` (:func:`backends.select.training_forward`),
        chosen once per layout, call shape and requested backend in ``step``."""
        # a training forward's choice follows the backward's (RAGGED_COMPILE_BACKWARD)
        key = (layout.id, hq, hkv, d, dtype, causal, self.backend,
               trains and config.choice(config.BACKWARD, config.BACKWARDS))
        kernel = step.kernels.get(key)
        if kernel is None or (kernel == "fa4" and fa4_backward.disabled()):
            kernel = None
            if trains:
                kernel = select.training_forward(
                    self.backend, self.device, dtype, d, hq, hkv, layout.pairs, causal,
                    (layout.n, layout.total_q, layout.total_k),
                )
            kernel = step.kernels[key] = kernel or self.plain_kernel(layout, hq, hkv, d, dtype, causal)
        return kernel

    def plain_kernel(self, layout: HostLayout, hq: int, hkv: int, d: int, dtype: torch.dtype, causal: bool) -> str:
        """:func:`backends.select.cuda_backend` for ``layout``, uncached."""
        return select.cuda_backend(
            self.backend, self.device, dtype, layout.n, layout.active, layout.active_k, layout.pairs,
            hq=hq, hkv=hkv, head_dim=d, causal=causal, max_q=layout.max_lens[0], total_q=layout.total_q,
        )

    def _acquire(self, step: PlannedStep, config: tuple) -> _Slot:
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
