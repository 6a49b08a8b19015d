"""CUDA-graph mode: one capture per bucket, re-planned before every replay.

``runtime.graphed(model, buckets)`` wraps a model that takes packed inputs,
``model(x, cu_seqlens)`` or ``model(x, cu_seqlens, kv, cu_seqlens_k)``. Each call:

1. reads the offsets on the host (free if they are CPU tensors, else one sync),
   picks the cheapest bucket that fits (buckets.py) and pads the layout to it;
2. the first time a bucket is used, allocates its static inputs, warms the model
   up on a side stream (this is where ``torch.compile`` compiles) and captures it;
3. copies the inputs into the static buffers, zeroes their padding rows, and
   re-plans every FlashInfer wrapper of the bucket for the new layout: the
   captured kernels read the plan from the wrappers' static buffers, so a replay
   computes the new layout, never the one seen at capture;
4. replays, and returns the real rows of every output (copied: the next replay
   overwrites the static output): the real tokens' rows of per-token outputs,
   the real segments' rows of per-segment outputs (a pooled embedding per
   segment), see :func:`real_rows`.

A layout larger than every bucket runs eagerly under ``runtime.step`` with the
host lengths, so it costs no sync and is still correct.

The traps this avoids (seen in serving runtimes: a graph keyed on total tokens
with frozen offsets computes the wrong attention for another layout of the same
total, sglang PR 16902): every replay is re-planned; the first plan latching the row
capacity (each wrapper is primed at its bucket's ceiling); NaN in padding
poisoning the last segment (padding input rows are zeroed; padding rows of
every attention output see no key, which FlashInfer writes as zero); a pinned
staging buffer rewritten while its copy is in flight (each wrapper alternates
between two staging buffers, and a buffer is reused only after the copy from it
has run, so planning step N+1 overlaps replay N).

Split-KV: a CUDA-graph fa2 plan splits long k/v segments whenever it is allowed
to (the split cannot change between replays), and the merge kernel after it
costs about as much as the attention on short segments (measured on the H200:
2.55 vs 2.59 ms per step, 8-layer encoder, ~250 segments of 16-256 tokens).
``split_kv="auto"`` therefore allows it only for buckets whose mean k/v tokens
per segment reach ``fi.AUTO_FA2_BELOW_MEAN_KV``, where few long segments need
it to fill the GPU.

Why the runtime owns the graphs rather than ``torch.compile(mode=
"reduce-overhead")``: a graph captured by Inductor would freeze the plan of the
capture-time layout. The op is tagged ``cudagraph_unsafe`` so reduce-overhead
partitions around it (attention then runs un-graphed, always correct).

On CPU there is nothing to capture: the same bookkeeping runs and the model is
called on the padded static buffers directly, which is what CI tests.

The runtime it is given supplies the float workspace, eager steps and stats;
``Runtime.graphed`` imports this module on first use. FlashInfer's pinned plan
buffer is swapped through ``backends/flashinfer.py`` alone.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils import _pytree as pytree

from .backends import flashinfer as fi
from .backends import select
from .buckets import Bucket, PaddedLayout, as_buckets, choose_bucket, pad_layout
from .runtime import Runtime
from .steps import Step, activate
from .validation import check_cu_seqlens_values

__all__ = ["GraphOwner", "GraphStep", "GraphedModel", "OUTPUT_KINDS", "real_rows"]

OUTPUT_KINDS = ("auto", "tokens", "segments", "whole")


def _check_outputs(outputs) -> None:
    if outputs is None:
        return
    for kind in pytree.tree_leaves(outputs):
        if kind not in OUTPUT_KINDS:
            raise ValueError(
                f"outputs must be one of {OUTPUT_KINDS} or a pytree of them shaped like the "
                f"model's output, got {kind!r}"
            )


def real_rows(out, outputs, *, rows: int, segments: int, total_q: int, n: int):
    """The rows of a padded call's output that belong to the real layout, copied.

    ``rows``/``segments``: the bucket's token rows and the segments the model
    saw (the bucket's segments plus the padding segment); ``total_q``/``n``: the
    real tokens and segments. ``outputs`` (see ``Runtime.graphed``) says per
    output tensor whether its first dimension runs over ``"tokens"``,
    ``"segments"`` or neither (``"whole"``); ``"auto"`` or None tells by size.
    """
    def leaf(kind, t):
        if not isinstance(t, torch.Tensor):
            return t
        size = t.shape[0] if t.dim() else None
        if kind == "auto":
            if rows == segments and size == rows:
                raise ValueError(
                    f"an output has {size} rows, which is both this bucket's token rows and "
                    f"its segments + 1: pass outputs='tokens' or 'segments' to graphed()"
                )
            kind = "tokens" if size == rows else "segments" if size == segments else "whole"
        want = {"tokens": rows, "segments": segments}.get(kind)
        if want is not None and size != want:
            raise ValueError(
                f"an output declared {kind!r} has shape {tuple(t.shape)}, but the bucket gives "
                f"{want} {kind} rows (dim 0); fix the outputs= given to graphed()"
            )
        keep = {"tokens": total_q, "segments": n}.get(kind)
        return (t if keep is None else t[:keep]).clone()

    if outputs is None or isinstance(outputs, str):
        kind = outputs or "auto"
        return pytree.tree_map(lambda t: leaf(kind, t), out)
    return pytree.tree_map(lambda kind, sub: pytree.tree_map(lambda t: leaf(kind, t), sub), outputs, out)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


class _GraphSlot:
    """A graph-mode wrapper for one (offsets, head config) of a capture.

    ``key`` names where its offsets come from: ("q", "q"), ("q", "k") or ("k", "k")
    here, a mask recipe in hf_graphs.py."""

    def __init__(self, wrapper, key, config, split_kv):
        self.wrapper = wrapper
        self.key = key
        self.config = config  # (hq, hkv, d, dtype, causal, scale)
        self.split_kv = split_kv
        pin = fi.staging_buffer(wrapper)
        self.staging = [pin, _pinned(torch.empty_like(pin))]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0


class _Entry:
    """Static buffers, wrappers and the captured graph of one bucket."""

    def __init__(self, bucket: Bucket, x, kv, device):
        self.bucket = bucket
        S = bucket.max_segments
        self.x = torch.zeros((bucket.max_tokens_q,) + tuple(x.shape[1:]), dtype=x.dtype, device=device)
        self.cu = {"q": torch.zeros(S + 2, dtype=torch.int32, device=device)}
        self.kv = None
        if kv is not None:
            self.kv = torch.zeros((bucket.max_tokens_k,) + tuple(kv.shape[1:]), dtype=kv.dtype, device=device)
            self.cu["k"] = torch.zeros(S + 2, dtype=torch.int32, device=device)
        self.slots: dict[tuple, _GraphSlot] = {}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None
        self.padded: PaddedLayout | None = None

    def args(self):
        if self.kv is None:
            return (self.x, self.cu["q"])
        return (self.x, self.cu["q"], self.kv, self.cu["k"])


def _indptr(padded: PaddedLayout, kind) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer indptrs of one layout kind: q side up to the bucket's ceiling (the
    padding segment), k/v side ending at the real total (the padding segment's
    keys are empty, so padding rows cost no attention)."""
    cu = {"q": padded.cu_q, "k": padded.cu_k}
    total = {"q": padded.total_q, "k": padded.total_k}
    kv = cu[kind[1]].clone()
    kv[-1] = total[kind[1]]
    return cu[kind[0]], kv


class GraphStep(Step):
    """The step the op's CUDA kernel sees during warm-up and capture of a bucket.

    ``entry.slots`` holds the graph-mode wrappers by (offsets key, head config);
    :meth:`offsets_key` names which offsets a call's ``cu_q``/``cu_k`` are (here:
    the entry's static offsets buffers, by address), and ``owner._new_slot(entry,
    key, config)`` makes the wrapper of a new pair, planned for the current call.
    """

    def __init__(self, owner: GraphOwner, entry):
        self.runtime = owner.runtime
        self.owner = owner
        self.entry = entry

    def offsets_key(self, cu_q: torch.Tensor, cu_k: torch.Tensor):
        names = {t.data_ptr(): name for name, t in self.entry.cu.items()}
        kind = (names.get(cu_q.data_ptr()), names.get(cu_k.data_ptr()))
        if None in kind:
            raise ValueError(
                "in CUDA-graph mode the model must pass the cu_seqlens it was called with "
                "to ragged_attention (unchanged: no copies or casts), so the runtime can "
                "re-plan them before each replay"
            )
        return kind

    def attention_with_lse(self, q, k, v, cu_q, cu_k, causal, scale, window=(-1, -1), trains=True):
        raise RuntimeError(
            "CUDA-graph mode is inference-only (a replay records no autograd graph): it "
            "captures under torch.no_grad(); train the model outside graph mode"
        )

    def max_lens(self, q, k, cu_q, cu_k):
        raise ValueError("CUDA-graph mode does not run attention dropout (a replay would redraw no mask); run it eagerly")

    def attention(self, q, k, v, cu_q, cu_k, causal, scale, window=(-1, -1), softcap=0.0):
        if window != (-1, -1) or softcap:
            # FlashAttention-2 sizes its grid from the longest segment, which a replay
            # for another layout would keep from the capture; graph plans take no variant.
            raise ValueError(
                "CUDA-graph mode runs plain FlashInfer attention only: sliding windows and softcap are "
                "not captured; run them eagerly"
            )
        reason = select.forward_reason(q.device, q.dtype, q.shape[-1])
        if reason is not None:  # the reference kernel reads offsets on the host: not capturable
            raise ValueError(f"CUDA-graph mode runs FlashInfer only: {reason}")
        key = self.offsets_key(cu_q, cu_k)
        config = (q.shape[1], k.shape[1], q.shape[2], q.dtype, causal, scale)
        slot = self.entry.slots.get((key, config))
        if slot is None:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "an attention configuration appeared during CUDA-graph capture that the "
                    "warm-up did not run; the model must run the same layers on every call"
                )
            slot = self.owner._new_slot(self.entry, key, config)
        self.runtime.count("flashinfer")
        return fi.run(slot.wrapper, q, k, v)


class GraphOwner:
    """What a graph-mode model keeps beside its captures: the runtime that plans for
    it, ``stats``, one graph memory pool for all its captures, and the float
    workspace of its graph-mode wrappers. :class:`GraphedModel` here and
    ``hf_graphs.GraphedHFModel`` build on it; it makes, plans and captures, they say
    which layouts."""

    def __init__(self, runtime: Runtime, split_kv, *, how: str):
        if split_kv not in ("auto", True, False):
            raise ValueError(f'split_kv must be "auto", True or False, got {split_kv!r}')
        if not isinstance(runtime, Runtime):
            raise TypeError(
                f"{type(self).__name__} needs the ragged_compile.Runtime that plans for it; make it with {how}"
            )
        self.runtime = runtime
        self.split_kv = split_kv
        self.stats: Counter = Counter()
        self._pool = None
        self._workspace: torch.Tensor | None = None  # float workspace of the graph-mode wrappers

    def make_slot(self, key, config, *, sequences: int, segments: int, rows_q: int, rows_k: int, device) -> _GraphSlot:
        """A graph-mode wrapper for offsets of ``segments`` segments over ``rows_q`` /
        ``rows_k`` rows, primed at that ceiling (its first plan latches the row
        capacity), not yet planned for a real layout. ``sequences``: the real
        sequences it serves, which choose fa2/fa3 and ``split_kv="auto"``."""
        hq, hkv, d, dtype, causal, scale = config
        backend = select.flashinfer_backend(  # graph mode plans FlashInfer, "varlen" runtimes too
            self.runtime.backend, self.runtime.device, sequences, rows_k,
            hq=hq, hkv=hkv, head_dim=d, causal=causal,
        )
        split_kv = self.split_kv
        if split_kv == "auto":
            split_kv = rows_k / sequences >= fi.AUTO_FA2_BELOW_MEAN_KV
        entries = 2 * segments + 1 if causal else segments + 1  # causal plans split every segment in two
        # Prime at the ceiling: the first plan latches the wrapper's row capacity.
        prime_q = torch.full((segments + 1,), rows_q, dtype=torch.int32)
        prime_k = torch.full((segments + 1,), rows_k, dtype=torch.int32)
        prime_q[0] = prime_k[0] = 0
        for attempt in range(3):
            if self._workspace is None:
                self._workspace = self.runtime.workspace()
            with torch.inference_mode(False):  # buffers planned later in and out of inference mode
                wrapper = fi.make_wrapper(
                    self._workspace,
                    backend,
                    qo_indptr_buf=torch.zeros(entries, dtype=torch.int32, device=device),
                    kv_indptr_buf=torch.zeros(entries, dtype=torch.int32, device=device),
                )
            try:
                fi.plan(wrapper, prime_q, prime_k, hq, hkv, d, dtype, causal, scale, split_kv=split_kv, causal_split=True)
                break
            except RuntimeError as err:
                need = fi.workspace_shortfall(err)
                if need is None or attempt == 2:
                    raise
                # Split-KV buffers for the whole bucket: grow this model's workspace
                # (wrappers made earlier keep theirs) and plan again.
                self._workspace = torch.empty(2 * need, dtype=torch.uint8, device=device)
        with torch.inference_mode(False):
            return _GraphSlot(wrapper, key, config, split_kv)

    def plan(self, slot: _GraphSlot, qo: torch.Tensor, kv: torch.Tensor) -> None:
        """Plan ``slot`` for host indptrs ``qo``/``kv``, outside any graph: a replay
        after it computes this layout. Staged in the slot's other pinned buffer, so
        this plan never rewrites one whose copy may still be in flight."""
        i = slot.turn
        event = slot.events[i]
        if event is not None and not event.query():
            self.stats["waits"] += 1
            event.synchronize()
        fi.set_staging_buffer(slot.wrapper, slot.staging[i])
        hq, hkv, d, dtype, causal, scale = slot.config
        fi.plan(slot.wrapper, qo, kv, hq, hkv, d, dtype, causal, scale, split_kv=slot.split_kv, causal_split=True)
        slot.events[i] = torch.cuda.Event()
        slot.events[i].record()
        slot.turn ^= 1
        self.stats["plans"] += 1
        self.runtime.count("plans")

    def capture(self, forward):
        """``(graph, out)``: ``forward()`` (which activates its step) warmed up twice
        on a side stream (this is where ``torch.compile`` compiles and the wrappers
        are made), then captured into this model's pool. Under ``torch.no_grad()``:
        a replay has no autograd graph, so none is recorded (and grad-requiring
        weights do not send attention to the training ops)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        self.stats["captures"] += 1
        return graph, out


class GraphedModel(GraphOwner):
    """``model`` under CUDA graphs across varying layouts; see the module docstring.

    Made by ``Runtime.graphed`` (which documents ``split_kv`` and ``outputs``).
    ``stats`` counts ``captures``, ``replays``, ``eager`` (layouts over every
    bucket), ``plans``, ``waits`` (a plan that waited for a staging copy) and
    ``syncs`` (device offsets read on the host).
    """

    def __init__(self, model, buckets, *, runtime: Runtime, split_kv="auto", outputs=None):
        super().__init__(runtime, split_kv, how="rc.Runtime().graphed(model, buckets)")
        _check_outputs(outputs)
        self.outputs = outputs
        self.model = model
        self.buckets = as_buckets(buckets)
        self.entries: dict[Bucket, _Entry] = {}

    def __call__(self, x, cu_seqlens, kv=None, cu_seqlens_k=None):
        if (kv is None) != (cu_seqlens_k is None):
            raise ValueError("pass kv and cu_seqlens_k together (cross-attention), or neither")
        if x.device != self.runtime.device:
            raise ValueError(
                f"x is on {x.device} but this model's runtime serves {self.runtime.device}; "
                f"make the runtime for x's device: rc.Runtime({str(x.device)!r}).graphed(...)"
            )
        if cu_seqlens.device.type != "cpu":
            self.stats["syncs"] += 1
        cu_q = cu_seqlens.to("cpu", torch.int64)
        check_cu_seqlens_values(cu_q, x.shape[0], "cu_seqlens")
        cu_k = cu_q
        if kv is not None:
            if cu_seqlens_k.device.type != "cpu":
                self.stats["syncs"] += 1
            cu_k = cu_seqlens_k.to("cpu", torch.int64)
            check_cu_seqlens_values(cu_k, kv.shape[0], "cu_seqlens_k")
            if cu_k.numel() != cu_q.numel():
                raise ValueError(
                    f"cu_seqlens has {cu_q.numel() - 1} segments but cu_seqlens_k has {cu_k.numel() - 1}"
                )
        n, total_q, total_k = cu_q.numel() - 1, int(cu_q[-1]), int(cu_k[-1])
        bucket = choose_bucket(self.buckets, n, total_q, total_k) if total_q else None
        if bucket is None:
            return self._eager(x, cu_seqlens, kv, cu_seqlens_k, cu_q, cu_k)
        padded = pad_layout(bucket, cu_q, cu_k)
        entry = self.entries.get(bucket)
        if entry is None:
            entry = self._capture(bucket, x, kv, padded)
        self._load(entry, x, kv, padded)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.out
        else:  # CPU: the same buffers, no graph
            out = self.model(*entry.args())
        self.stats["replays"] += 1
        return real_rows(
            out, self.outputs, rows=bucket.max_tokens_q, segments=bucket.max_segments + 1,
            total_q=total_q, n=n,
        )

    # -- pieces ---------------------------------------------------------------
    def _eager(self, x, cu_seqlens, kv, cu_seqlens_k, cu_q, cu_k):
        self.stats["eager"] += 1
        # The model gets offsets on its own device, as in graph mode.
        cu_seqlens = cu_seqlens.to(x.device, non_blocking=True)
        if kv is not None:
            cu_seqlens_k = cu_seqlens_k.to(x.device, non_blocking=True)
        args = (x, cu_seqlens) if kv is None else (x, cu_seqlens, kv, cu_seqlens_k)
        if x.device.type != "cuda":
            return self.model(*args)
        rt = self.runtime
        lens_q = (cu_q[1:] - cu_q[:-1]).tolist()
        lens_k = None if kv is None else (cu_k[1:] - cu_k[:-1]).tolist()
        with rt.step(lens_q, lens_k):
            return self.model(*args)

    def _load(self, e: _Entry, x, kv, padded: PaddedLayout) -> None:
        """Inputs into static buffers and plans into the wrappers, all outside any graph."""
        e.padded = padded
        T = x.shape[0]
        e.x[:T].copy_(x)
        e.x[T:].zero_()
        e.cu["q"].copy_(_pinned(padded.cu_q), non_blocking=True)
        if kv is not None:
            e.kv[: kv.shape[0]].copy_(kv)
            e.kv[kv.shape[0] :].zero_()
            e.cu["k"].copy_(_pinned(padded.cu_k), non_blocking=True)
        for slot in e.slots.values():
            self.plan(slot, *_indptr(padded, slot.key))

    def _new_slot(self, e: _Entry, kind, config) -> _GraphSlot:
        b = e.bucket
        slot = self.make_slot(
            kind, config, sequences=b.max_segments, segments=b.max_segments + 1,
            rows_q=b.max_tokens_q if kind[0] == "q" else b.max_tokens_k,
            rows_k=b.max_tokens_q if kind[1] == "q" else b.max_tokens_k,
            device=e.x.device,
        )
        self.plan(slot, *_indptr(e.padded, kind))
        e.slots[(kind, config)] = slot
        return slot

    def _capture(self, bucket: Bucket, x, kv, padded: PaddedLayout) -> _Entry:
        e = _Entry(bucket, x, kv, x.device)
        self._load(e, x, kv, padded)
        if x.device.type != "cuda":
            self.entries[bucket] = e
            return e
        step = GraphStep(self, e)

        def forward():
            with activate(step):
                return self.model(*e.args())

        e.graph, e.out = self.capture(forward)
        self.entries[bucket] = e  # only once captured: a failed capture leaves no half-built entry
        return e
