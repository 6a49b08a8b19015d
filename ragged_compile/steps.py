"""Steps: what the op's CUDA kernels call within one forward, and how they find
a layout's plan with no host work on the hot path.

* A *step* spans one forward. ``Runtime.step(...)`` opens a :class:`PlannedStep`
  (``ragged_compile.compile`` opens one around every call of the compiled
  model, outside the compiled region); CUDA-graph mode opens its own during
  capture (cudagraph.py). :func:`activate` makes a step the one the kernels see
  on this thread, so two threads never see each other's plans.
* Within a planned step, a layout is known either from host lengths given to
  ``step()`` (no device-to-host sync at all) or, the first time a ``cu_seqlens``
  tensor is seen, by copying it to the host once (one sync per distinct layout
  per step), when its values are also checked.
* Plans are cached per (layout, heads, head dim, dtype, causal, scale, backend,
  stream) for the step, so a 24-layer model plans once, not 24 times.
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
keeps an :class:`ImplicitStep` per runtime: a plan is reused while the very
offsets tensors it was made from are alive and unmodified (:class:`OffsetsCache`:
object identity through a weak reference, so a freed tensor whose id or memory
is reused never matches, plus the in-place version). An eager 8-layer forward
over one NJT therefore plans and syncs once, not 8 times.
"""

from __future__ import annotations

import abc
import itertools
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .backends import fa4_forward, flash_backward, select, window_forward
from .backends import flashinfer as fi
from .logs import warn_once
from .reference import reference_attention
from .validation import check_cu_seqlens_values, debug_checks

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = [
    "Step", "PlannedStep", "ImplicitStep", "HostLayout", "OffsetsCache",
    "activate", "current_step", "tensor_version", "fast_attention", "repeated_training_call", "run_repeated_training",
]

IMPLICIT_LAYOUTS = 4  # layouts an implicit step keeps planned (wrappers it holds per config)
_ids = itertools.count()


class Step(abc.ABC):
    """What the op's CUDA kernels call during one forward.

    ``runtime`` is the :class:`~ragged_compile.Runtime` that plans for it;
    ``trains`` is set once a training forward ran in it (the runtime then keeps
    it past its end for activation-checkpoint recomputes).
    """

    runtime: Runtime
    trains: bool = False

    @abc.abstractmethod
    def attention(
        self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0
    ) -> torch.Tensor:
        """The inference op's CUDA kernel; ``window`` ``(left, right)``, -1 unbounded;
        ``softcap`` > 0 caps the scores (0: off)."""

    @abc.abstractmethod
    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=(-1, -1),
                           trains: bool = True):
        """The training forward's CUDA kernel: ``(out, lse, (max_q, max_k, pairs))``
        (``pairs``: query-key pairs per head, which picks the backward's kernel);
        ``trains=False``: an inference call that needs the LSE (sinks)."""

    @abc.abstractmethod
    def max_lens(self, q, k, cu_q, cu_k) -> tuple[int, int]:
        """The longest q and k segment of these offsets, from the host layout."""

    def knows(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> bool:
        """Whether this step identified these offsets."""
        return False

    def prefetch(self, cu: torch.Tensor) -> None:
        """Start reading offsets the forward will need to the host, without waiting."""

    def release(self, tick: int) -> None:
        """Give back what the step holds (its wrappers) at its end."""


_local = threading.local()


@contextmanager
def activate(step: Step):
    """Make ``step`` the one the op's CUDA kernels see on this thread."""
    stack = _local.__dict__.setdefault("steps", [])
    stack.append(step)
    try:
        yield step
    finally:
        stack.pop()


def current_step() -> Step | None:
    """The innermost active step on this thread, or None."""
    stack = getattr(_local, "steps", None)
    return stack[-1] if stack else None


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

    def __init__(self, capacity: int = IMPLICIT_LAYOUTS):
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
class HostLayout:
    """One segment layout, as host offsets (int32), with what planning and the
    training backward read of it."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        # numpy on the host copies: a forward's first layer pays for this, and torch's
        # CPU ops cost microseconds each on tensors this small
        cu_q, cu_k = self.cu_q.numpy().astype(np.int64), self.cu_k.numpy().astype(np.int64)
        self.n = cu_q.shape[0] - 1
        self.total_q, self.total_k = int(cu_q[-1]), int(cu_k[-1])
        lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
        # the training backward's grid sizes, read here so it never syncs
        self.max_lens = (int(lens_q.max()), int(lens_k.max())) if self.n else (0, 0)
        # segments with work on both sides: padded layouts carry empty ones that the
        # kernel choice, fitted on layouts without them, must not count
        active = (lens_q > 0) & (lens_k > 0)
        self.active, self.active_k = int(active.sum()), int(lens_k[active].sum())
        self.pairs = int((lens_q * lens_k).sum())  # query-key pairs per head: the work
        # whether some query row sees no key, without / with causal (bottom-right)
        self.keyless_rows = (bool(((lens_q > 0) & (lens_k == 0)).any()), bool((lens_q > lens_k).any()))
        self._device_cu: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._fa2_cu: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # see fa2_offsets
        self._window_tiles: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_lengths(cls, seq_lens_q, seq_lens_k=None) -> HostLayout:
        cu_q = _as_offsets(seq_lens_q)
        cu_k = cu_q if seq_lens_k is None else _as_offsets(seq_lens_k)
        if cu_k.numel() != cu_q.numel():
            raise ValueError(
                f"seq_lens_q has {cu_q.numel() - 1} segments but seq_lens_k has "
                f"{cu_k.numel() - 1}; pair each q segment with one k/v segment"
            )
        return cls(cu_q, cu_k)

    def fa2_offsets(self, device: torch.device, cu_q: torch.Tensor, cu_k: torch.Tensor):
        """Offsets for a FlashAttention-2 call: the call's own, or, past the kernel's
        segment limit, this layout without its segments empty on both sides (they
        produce no row): a compiled packed layout keeps one slot per token."""
        if self.n <= flash_backward.MAX_SEGMENTS:
            return cu_q, cu_k
        if device not in self._fa2_cu:
            lq, lk = self.cu_q[1:] - self.cu_q[:-1], self.cu_k[1:] - self.cu_k[:-1]
            keep = torch.cat([torch.ones(1, dtype=torch.bool), (lq > 0) | (lk > 0)])
            self._fa2_cu[device] = (self.cu_q[keep].to(device, non_blocking=True),
                                    self.cu_k[keep].to(device, non_blocking=True))
        return self._fa2_cu[device]

    def window_tiles(self, device: torch.device) -> torch.Tensor:
        """window_forward.py's table of this layout's query tiles, on ``device``: built
        once, for every windowed layer of a forward."""
        if device not in self._window_tiles:
            tiles = torch.from_numpy(window_forward.tiles(self.cu_q.numpy()))
            self._window_tiles[device] = tiles.to(device, non_blocking=True)  # staged: no sync
        return self._window_tiles[device]

    def device_offsets(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._device_cu:
            self._device_cu[device] = (
                self.cu_q.to(device, non_blocking=True),
                self.cu_k.to(device, non_blocking=True),
            )
        return self._device_cu[device]


@dataclass(slots=True)
class _Resolved:
    """An eager call's resolution, valid while its offsets are the very tensors,
    unmodified, and its step and plan are the ones in force."""

    ref_q: weakref.ref
    ref_k: weakref.ref
    version_q: int
    version_k: int
    n: int
    device: int
    stream: int
    slot: object  # FlashInfer's planned wrapper, or None for "varlen"
    backend: str | None
    requested: str  # the runtime's backend then: a change takes effect at the next call
    max_lens: tuple[int, int] | None = None  # "varlen": its grid, from the host layout
    lens: tuple[int, int, int] | None = None  # training: (max_q, max_k, pairs) for the backward
    work: tuple | None = None  # training: select.backward_kernel's (work, slots) for this layout
    runtime: object = None  # the step's runtime (counts, last_backend)


def _repeat(table: str, q, k, v, cu_q, cu_k, causal: bool, scale):
    """The resolution an earlier call of this step left in its ``table`` for a call
    with the same offsets tensors (identity and in-place version), q/k shapes,
    dtype, causality, scale, device, stream and requested backend; None if none."""
    ref = _local.__dict__.get("last")
    step = None if ref is None else ref()
    if step is None:
        return None
    active = current_step()
    if active is not step and (active is not None or step.runtime._local.__dict__.get("implicit") is not step):
        return None
    hit = getattr(step, table).get((id(cu_q), id(cu_k), q.shape, k.shape, q.dtype, causal, scale))
    if (
        hit is None or hit.ref_q() is not cu_q or hit.ref_k() is not cu_k
        or cu_q._version != hit.version_q or cu_k._version != hit.version_k or cu_q.shape[0] != hit.n
        or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype
        or q.get_device() != hit.device or k.get_device() != hit.device or v.get_device() != hit.device
    ):
        return None
    if hit.runtime._current_stream() != hit.stream or hit.runtime.backend != hit.requested:
        return None
    return hit


def fast_attention(q, k, v, cu_q, cu_k, causal: bool, scale) -> torch.Tensor | None:
    """The inference kernel of a call that repeats an earlier call of this step
    (:func:`_repeat`), on the plan that call ran (unless it was re-planned since:
    ``fi.replay`` checks). Every check the first call passed depends only on
    what :func:`_repeat` compares, so this call runs the kernel directly. None
    where it is not such a call: the caller takes the full path. The caller has
    checked that the call is eager, plain attention on plain tensors, and needs
    no gradient."""
    hit = _repeat("fast", q, k, v, cu_q, cu_k, causal, scale)
    if hit is None:
        return None
    rt = hit.runtime
    if hit.slot is None:  # PyTorch's FlashAttention-2: no plan, the layout's grid
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return None
        out = flash_backward.forward_unpadded(q, k, v, cu_q, cu_k, *hit.max_lens, causal, scale)
        rt.count("varlen")
    else:
        out = fi.replay(hit.slot.wrapper, q, k, v)
        if out is None:
            return None
        rt.count("flashinfer")
    rt.last_backend = hit.backend
    return out


def repeated_training_call(q, k, v, cu_q, cu_k, causal: bool, scale) -> _Resolved | None:
    """:func:`fast_attention`'s lookup for a training call (forward with its LSE): the
    resolution of an earlier training call of this step that this one repeats,
    for :func:`run_repeated_training` inside the op's autograd function, or None."""
    hit = _repeat("fast_lse", q, k, v, cu_q, cu_k, causal, scale)
    if hit is None or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    return hit


def run_repeated_training(hit: _Resolved, q, k, v, cu_q, cu_k, causal: bool, scale, lse: bool = True):
    """``(out, lse, lens)`` as :meth:`PlannedStep.attention_with_lse` gives them, for a
    call :func:`repeated_training_call` resolved; None where the recorded kernel
    call cannot be replayed (the caller takes the full path).

    ``lse=False``, for a FlashAttention-2 resolution (``hit.slot`` None) only:
    ``out`` alone, from aten's forward called as it is, so that under grad mode
    autograd records aten's own backward node (FlashAttention-2's backward, in C++)."""
    rt = hit.runtime
    if hit.slot is None:
        got = flash_backward.forward_unpadded(q, k, v, cu_q, cu_k, *hit.max_lens, causal, scale, lse=lse)
        rt.count("varlen")
    else:
        got = fi.replay(hit.slot.wrapper, q, k, v, lse=True)
        if got is None:
            return None
        got = (got[0], flash_backward.lse_from_flashinfer(got[1]))
        rt.count("flashinfer")
    rt.last_backend = hit.backend
    return (*got, hit.lens) if lse else got


class PlannedStep(Step):
    """A step that plans FlashInfer for the layouts it meets (see the module docstring)."""

    def __init__(self, runtime: Runtime, declared: list[HostLayout]):
        self.runtime = runtime
        self.declared = declared
        self.by_tensor: dict[tuple, HostLayout] = {}
        self.host: dict[tuple, torch.Tensor | tuple] = {}  # offsets read (or being read) to the host
        self.held: list[torch.Tensor] = []  # keeps identified offsets' memory from reuse
        self.plans: dict[tuple, tuple] = {}
        self.kernels: dict[tuple, str] = {}  # see Runtime.kernel
        self.slots: list = []  # the runtime's wrapper slots this step holds
        self.fast: dict[tuple, _Resolved] = {}  # see fast_attention
        self.fast_lse: dict[tuple, _Resolved] = {}  # see repeated_training_call

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
            self.runtime.count("syncs")
        elif hit is None:
            known = self.runtime.known_offsets(cu)
            if known is None:
                known = cu.to("cpu", torch.int32)
                self.runtime.count("syncs")
            hit = self.host[key] = known
            self.held.append(cu)
        return hit

    def layout_for(self, cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> HostLayout:
        key_q = self._key(cu_q)
        key = (key_q, key_q if cu_k is cu_q else self._key(cu_k))  # self-attention: one key, per call
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
            layout = matches[0] if len(matches) == 1 else HostLayout(host_q, host_k)
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

    def _checked_layout(self, q, k, cu_q, cu_k) -> HostLayout:
        layout = self.layout_for(cu_q, cu_k, q.shape[0], k.shape[0])
        if debug_checks():
            dq, dk = layout.device_offsets(q.device)
            if not (torch.equal(dq, cu_q.to(dq.dtype)) and torch.equal(dk, cu_k.to(dk.dtype))):
                raise ValueError("cu_seqlens do not match the layout planned for this step")
        return layout

    def attention(
        self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0
    ) -> torch.Tensor:
        rt = self.runtime
        if window != (-1, -1) and not softcap:  # the caller checked select.forward_kernel: "fa2"
            layout = self._checked_layout(q, k, cu_q, cu_k)
            return self._windowed(layout, q, k, v, cu_q, cu_k, causal, scale, window, fa2_offsets=True)[0]
        reason = select.forward_reason(q.device, q.dtype, q.shape[-1])
        if reason is not None:
            warn_once(f"{reason}: CUDA ragged attention runs the (slow, exact) reference kernel")
            rt.count("reference")
            rt.last_backend = "reference"
            return reference_attention(q, k, v, cu_q, cu_k, causal, scale, window_size=window, softcap=softcap)
        total_q, total_k = q.shape[0], k.shape[0]
        layout = self._checked_layout(q, k, cu_q, cu_k)
        if total_q == 0:
            return q.new_empty(q.shape)
        if total_k == 0:
            return q.new_zeros(q.shape)
        kernel = None if softcap else rt.kernel(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal)
        if kernel == "varlen":
            rt.count("varlen")
            rt.last_backend = "varlen"
            out = flash_backward.forward(q, k, v, cu_q, cu_k, *layout.max_lens, causal, scale)[0]
            if layout.max_lens[0] and layout.max_lens[1] and q.shape[2] == flash_backward.fa2_head_dim(q.shape[2]):
                self._remember(q, k, cu_q, cu_k, causal, scale, None, layout.max_lens)
            return out
        # softcap (the caller checked select.cuda_runs_reference): FlashInfer caps, and
        # bounds the window's left side, at plan time
        window_left = select.flashinfer_window(causal, window) if softcap else -1
        slot = rt.plan(
            self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale, window_left, softcap, kernel,
        )
        rt.count("flashinfer")
        out = fi.run(slot.wrapper, q, k, v)
        if not softcap:
            self._remember(q, k, cu_q, cu_k, causal, scale, slot)
        return out

    def _windowed(self, layout, q, k, v, cu_q, cu_k, causal, scale, window, fa2_offsets: bool):
        """``(out, lse)`` of a windowed call (no softcap): window_forward.py's kernel
        for short windows (from the layout's query tiles, no sync), else
        FlashAttention-2's (``fa2_offsets``: past its segment limit, the layout
        without its empty segments)."""
        rt = self.runtime
        kernel = select.window_kernel(q.device, q.dtype, q.shape[-1], causal, window)
        rt.count(kernel)
        rt.last_backend = kernel
        if kernel == "window":
            if not fa2_offsets:  # a training call: say now what FlashAttention-2's backward would
                flash_backward._check_segment_slots(cu_q)
            return window_forward.forward(q, k, v, cu_q, cu_k, layout.window_tiles(q.device), causal, scale, window)
        if fa2_offsets:
            cu_q, cu_k = layout.fa2_offsets(q.device, cu_q, cu_k)
        return flash_backward.forward(q, k, v, cu_q, cu_k, *layout.max_lens, causal, scale, window)

    def _remember(self, q, k, cu_q, cu_k, causal, scale, slot, max_lens=None, lens=None, layout=None) -> None:
        """Keep what this call resolved, so that the next layer's call with the same
        offsets and shapes goes straight to the kernel (:func:`fast_attention`; with
        ``lens``, a training call's, :func:`repeated_training_call`): FlashInfer's
        planned ``slot``, or (``slot`` None) FlashAttention-2 with the layout's
        ``max_lens``, on int32 offsets it takes as they are."""
        vq, vk = tensor_version(cu_q), tensor_version(cu_k)
        if vq is None or vk is None:
            return  # inference tensors: edits would go unseen
        if slot is None and not all(
            cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device for cu in (cu_q, cu_k)
        ):
            return
        key = (id(cu_q), id(cu_k), q.shape, k.shape, q.dtype, causal, scale)
        work = None
        if lens is not None:  # what select.backward_kernel weighs, as _cuda_backward computes it
            work = (select.backward_work(q.shape[1], k.shape[1], q.shape[0], k.shape[0], lens[2], causal),
                    (layout.n, q.shape[0], k.shape[0]))
        (self.fast if lens is None else self.fast_lse)[key] = _Resolved(
            weakref.ref(cu_q), weakref.ref(cu_k), vq, vk, cu_q.shape[0], q.get_device(),
            self.runtime._current_stream(), slot, self.runtime.last_backend, self.runtime.backend, max_lens,
            lens, work, self.runtime,
        )
        _local.last = weakref.ref(self)

    def max_lens(self, q, k, cu_q, cu_k) -> tuple[int, int]:
        return self._checked_layout(q, k, cu_q, cu_k).max_lens

    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=(-1, -1),
                           trains: bool = True, softcap: float = 0.0):
        """:meth:`attention` for training: also the LSE in the backward's layout
        (``[Hq, Tq]`` fp32, natural log, ``+inf`` for keyless rows; see
        backends/flash_backward.py) and the longest q and k segment and the pair
        count from the host layout, so the backward needs no sync. The caller
        checked support.
        ``trains``: the runtime keeps the step for recomputes (not for inference)."""
        rt = self.runtime
        self.trains = self.trains or trains
        total_q, total_k = q.shape[0], k.shape[0]
        layout = self._checked_layout(q, k, cu_q, cu_k)
        max_lens = layout.max_lens
        lens = (*max_lens, layout.pairs)
        if softcap and total_q and total_k:
            # FlashInfer caps (and bounds a left window) at plan time; its LSE, of the
            # capped scores, is what segment_backward.py's backward takes
            slot = rt.plan(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale,
                           select.flashinfer_window(causal, window), softcap)
            rt.count("flashinfer")
            out, lse = fi.run_with_lse(slot.wrapper, q, k, v)
            return out, flash_backward.lse_from_flashinfer(lse), lens
        if window != (-1, -1) and not softcap:  # an LSE FlashAttention-2's backward takes as it is
            # a backward takes the call's offsets: the forward must match them
            out, lse = self._windowed(layout, q, k, v, cu_q, cu_k, causal, scale, window, fa2_offsets=not trains)
            return out, lse, lens
        if total_q == 0 or total_k == 0:
            lse = torch.full((q.shape[1], total_q), float("inf"), dtype=torch.float32, device=q.device)
            return q.new_zeros(q.shape), lse, lens
        kernel = rt.kernel(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, trains=trains)
        if kernel == "fa4":  # its LSE is its backward's as it is
            try:
                out, lse = fa4_forward.forward(q, k, v, cu_q, cu_k, causal, scale, max_lens,
                                               layout.keyless_rows[causal])
            except fa4_forward.KernelFailed as err:  # select decides: re-raise, or no FA4 from now on
                select.fa4_failed(err, q.device, q.dtype, q.shape[-1], "forward", forced=rt.backend == "fa4")
                kernel = rt.kernel(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, trains=trains)
            else:
                rt.count("fa4")
                rt.last_backend = "fa4"
                return out, lse, lens
        if kernel == "varlen":
            # its LSE is already the backward's (no conversion); varlen runs only
            # within FlashAttention-2's segment limit, so on the call's own offsets
            rt.count("varlen")
            rt.last_backend = "varlen"
            out, lse = flash_backward.forward(q, k, v, cu_q, cu_k, *max_lens, causal, scale)
            if trains and max_lens[0] and max_lens[1] and q.shape[2] == flash_backward.fa2_head_dim(q.shape[2]):
                self._remember(q, k, cu_q, cu_k, causal, scale, None, max_lens, lens, layout)
            return out, lse, lens
        slot = rt.plan(self, layout, q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale, backend=kernel)
        rt.count("flashinfer")
        out, lse = fi.run_with_lse(slot.wrapper, q, k, v)
        if trains:
            self._remember(q, k, cu_q, cu_k, causal, scale, slot, lens=lens, layout=layout)
        return out, flash_backward.lse_from_flashinfer(lse), lens


class ImplicitStep(PlannedStep):
    """The step of calls made outside any ``Runtime.step`` on one thread: layouts
    are found through :class:`OffsetsCache`, and nothing is held alive."""

    def __init__(self, runtime: Runtime):
        super().__init__(runtime, [])
        self.layouts = OffsetsCache(IMPLICIT_LAYOUTS)
        self.identified = 0  # layouts planned for (the wrappers it holds grow with it)
        self.reads = OffsetsCache(2 * IMPLICIT_LAYOUTS)  # host copies, per tensor

    def knows(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> bool:
        return self.layouts.get((cu_q, cu_k)) is not None

    def spent(self) -> bool:
        """No layout of it is usable any more, or it holds as many as it may."""
        return self.identified >= IMPLICIT_LAYOUTS or (self.identified > 0 and len(self.layouts) == 0)

    def _host(self, cu: torch.Tensor) -> torch.Tensor:
        host = self.reads.get((cu,))
        if host is None:
            host = self.runtime.known_offsets(cu)
            if host is None:
                host = cu.to("cpu", torch.int32, copy=True)  # never an alias of the user's tensor
                self.runtime.count("syncs")
            self.reads.put((cu,), host)
        return host

    def layout_for(self, cu_q, cu_k, total_q: int, total_k: int) -> HostLayout:
        layout = self.layouts.get((cu_q, cu_k))
        if layout is not None:
            return layout
        host_q, host_k = self._host(cu_q), self._host(cu_k)
        check_cu_seqlens_values(host_q, total_q, "cu_seqlens_q")
        check_cu_seqlens_values(host_k, total_k, "cu_seqlens_k")
        layout = HostLayout(host_q, host_k)
        self.layouts.put((cu_q, cu_k), layout)
        self.identified += 1
        return layout
