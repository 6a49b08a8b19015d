"""CUDA graphs for transformers models called padded: ``hf.graphed(model, buckets)``.

What serving runtimes do with profiles over (batch, padded length)::

    g = ragged_compile.hf.graphed(model, [(64, 64), (64, 128), (16, 512)])
    out = g(input_ids=ids, attention_mask=mask)   # what model(...) returns, from a replay

    # sentence-transformers: encode() through it, one line (ST calls auto_model.forward)
    st_model[0].auto_model.forward = ragged_compile.hf.graphed(st_model[0].auto_model)

Shape legend:

    ======  ===============================================================
    B, S    the call: ``input_ids`` / ``attention_mask`` are ``[B, S]``
    Bb, Lb  its bucket: the cheapest ``(batch, length)`` with B <= Bb and
            S <= Lb (fewest padded tokens Bb * Lb, then the shorter length)
    T       Bb * Lb: the query and key rows of every attention layer of a replay
    ======  ===============================================================

``buckets``: ``(batch, length)`` pairs, or None for :func:`~ragged_compile.buckets.
default_padded_buckets` (batches 1..64 x lengths 16..512, capped at the model's
position limit). A call:

1. reads the mask on the host: free when it is a CPU tensor (``tokenizer(...,
   return_tensors="pt")`` gives one; inputs may stay on the CPU, they are copied
   into the bucket's buffers), else one device-to-host copy, the only one; checks
   that each row's valid tokens are one run (right or left padding);
2. picks its bucket. The first call of a bucket (per set of arguments: which
   inputs are given, flags such as ``return_dict``) allocates static
   ``[Bb, Lb]`` inputs, warms the model up twice on a side stream and captures
   one CUDA graph of the whole forward;
3. copies its inputs into the top-left ``[B, S]`` corner of the static buffers;
   the rest is padding: mask 0, ``pad_token_id``, token type and position 0. The
   real tokens keep their columns, so their positions are the caller's, also
   under left padding;
4. re-plans every FlashInfer wrapper of the graph for this call's mask (below),
   replays, and returns the model's output type (a ``ModelOutput``, or a tuple
   for ``return_dict=False``) with every tensor cut back to the caller's rows and
   columns and copied: ``last_hidden_state`` ``[B, S, H]``, ``pooler_output``
   ``[B, H]``, ``hidden_states``, logits. Which dims run over the batch and which
   over the length is read once per capture from an eager probe call of another
   shape, so a hidden size equal to a bucket length confuses nothing.

What is captured: the model's forward on the static buffers, with its attention
layers on the ragged op, and the padded layout each of them takes from the mask
(hf.py's segments per row, ``[pad k | queries + run | pad k]`` or, causal,
``[pad q | pad k | tokens | pad q | pad k]``): device arithmetic of static shape
on the static mask (``hf._layout_of_runs``), inside the graph.

The re-plan-before-replay rule: FlashInfer's kernels read their schedule from
the wrapper's plan, and a plan is host work from host offsets, so a replay
computes the attention of whatever its wrappers were last planned for. The
classic bug is a graph keyed on shapes with the plan frozen at capture: the same
shapes with another mask then compute the wrong attention. Here, while a bucket
is warmed up and captured, the step the op sees (``_MaskGraphStep``) hands out
graph-mode wrappers (static indptr buffers, primed at T rows, one per layout and
head config) and records for each the *recipe* its offsets come from: hf.py's
padded layout of the call's mask for (query length, key length, causal). Before
every replay each wrapper is planned from the host offsets that the same
function computes from the host copy of the new call's mask. No plan outlives
its call. Checked: on CPU every call compares the layout computed from the
static mask with the host recipe's; on CUDA the warm-ups of each capture do (a
sync per capture, not per call), and under ``RAGGED_COMPILE_DEBUG=1`` so does
every replay.

On CPU there is nothing to capture: the same bookkeeping runs (bucket, padding
into static buffers, recipes) and the model is called on the padded buffers,
which is what CI tests.

Calls that run eagerly (the model as given, under ``torch.no_grad()``): those
larger than every bucket (on CUDA in a runtime step that plans from the host
layout of the mask read once, so no second read), and those graph mode does not
take, logged once per reason at WARNING on the "ragged_compile" logger: a model
in training mode, tensor arguments other than ``input_ids`` /
``inputs_embeds`` / ``attention_mask`` / ``token_type_ids`` / ``position_ids``
(``labels``, caches, ...), ``use_cache=True``, ``output_attentions=True``,
masks that are not one run of valid tokens per row.

Limits:

* inference only: every call runs under ``torch.no_grad()`` (outputs do not
  require grad, even where the weights do);
* self-attention that sees the call's 2-D padding mask: encoders, and decoders
  without a cache (captured with ``use_cache=False``: no ``past_key_values`` come
  back). A model whose attention sees something else raises at capture;
* an eager model (not ``torch.compile``'d: pass the module itself);
* sliding windows shorter than the bucket length (ModernBERT's local layers)
  run the model's eager attention on the padded mask inside the graph, as hf.py's
  fallbacks do: correct, slower;
* one call at a time (one thread, one stream): the buffers are static;
* ``graphed`` sets the model's ``attn_implementation`` to :data:`GRAPH_NAME`,
  whose attention outside graph mode is ``hf.register()``'s;
* memory: each bucket used keeps its static inputs and outputs; the graphs share
  one pool.
"""

from __future__ import annotations

import inspect
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from . import hf, hf_unpad
from .buckets import PaddedBucket, as_padded_buckets, choose_bucket, default_padded_buckets
from .cudagraph import GraphOwner, GraphStep
from .logs import log, warn_once
from .ops import ragged_attention
from .runtime import Runtime, get_runtime
from .steps import HostLayout, PlannedStep, activate, current_step
from .validation import debug_checks

__all__ = ["graphed", "GraphedHFModel", "GRAPH_NAME", "register"]

GRAPH_NAME = "ragged_graphs"  # the attn_implementation graphed() sets

# Per-token inputs graph mode pads into the bucket (any other tensor argument runs eagerly).
_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids", "position_ids")
_FLAG_TYPES = (bool, int, float, str)  # non-tensor arguments a capture is keyed on

_register_lock = threading.Lock()
_registered = False


def register() -> str:
    """Register :data:`GRAPH_NAME` with transformers (idempotent): hf.py's mask
    function, and :func:`attention_forward`."""
    global _registered
    hf.register()  # the transformers version check
    with _register_lock:
        if not _registered:
            from transformers.masking_utils import AttentionMaskInterface
            from transformers.modeling_utils import AttentionInterface

            AttentionInterface.register(GRAPH_NAME, attention_forward)
            AttentionMaskInterface.register(GRAPH_NAME, hf.mask_function)
            _registered = True
    return GRAPH_NAME


def graphed(model, buckets=None, *, runtime: Runtime | None = None, split_kv="auto") -> GraphedHFModel:
    """``model`` (a transformers model called ``(input_ids, attention_mask, ...)``)
    under CUDA graphs, one capture per ``(batch, length)`` bucket: see the module
    docstring. ``runtime``: the :class:`~ragged_compile.Runtime` that plans for it
    (default: the model's device's); ``split_kv`` as ``Runtime.graphed``."""
    return GraphedHFModel(model, buckets, runtime=runtime, split_kv=split_kv)


# -- layouts: on the device from the mask, on the host from its copy ----------------------


class Recipe(NamedTuple):
    """hf.py's padded layout of a ``[B, sk]`` mask for ``sq`` queries per row."""

    sq: int
    sk: int
    causal: bool


class _HostMask:
    """A call's mask on the host, as each row's valid run (``start``, ``n``: hf.py's
    ``_runs``), and each recipe's offsets."""

    def __init__(self, start: torch.Tensor, n: torch.Tensor):
        self.start, self.n = start, n
        self._offsets: dict[Recipe, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of(cls, valid: torch.Tensor) -> _HostMask:
        return cls(*hf._runs(valid))

    def offsets(self, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
        """Host int32 ``(cu_q, cu_k)``: the function hf.py runs on the device, on the host runs."""
        hit = self._offsets.get(recipe)
        if hit is None:
            seg = hf._layout_of_runs(self.start, self.n, recipe.sq, recipe.sk, recipe.causal)
            hit = self._offsets[recipe] = (seg.cu_q, seg.cu_k)
        return hit


class _MaskLayouts:
    """The layouts one forward's attention layers take from their mask, made on the
    device by hf.py's function, each remembered with its recipe (by the offsets'
    addresses: this object holds them, so no other tensor takes those addresses
    while it lives). ``check``: compare each with the host recipe's offsets where
    that costs no capture (CPU, warm-up)."""

    def __init__(self, host: _HostMask, check: bool):
        self.host = host
        self.check = check
        self._layouts: dict[tuple, object] = {}  # (mask address, shape, recipe) -> hf._Segments
        self._recipes: dict[tuple[int, int], Recipe] = {}

    def layout(self, mask: torch.Tensor, sq: int, causal: bool):
        recipe = Recipe(sq, mask.shape[-1], causal)
        key = (mask.data_ptr(), tuple(mask.shape), recipe)
        seg = self._layouts.get(key)
        if seg is None:
            seg = hf._padded_layout(mask.to(torch.bool), sq, causal)
            if self.check and not (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._compare(seg, recipe, self.host)
            self._layouts[key] = seg
            self._recipes[(seg.cu_q.data_ptr(), seg.cu_k.data_ptr())] = recipe
        return seg

    def recipe_of(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> Recipe | None:
        return self._recipes.get((cu_q.data_ptr(), cu_k.data_ptr()))

    def compare_all(self, host: _HostMask) -> None:
        """Every layout of this forward (a captured one: what the last replay
        computed) against ``host``'s recipes: one sync each."""
        for (_, _, recipe), seg in self._layouts.items():
            self._compare(seg, recipe, host)

    @staticmethod
    def _compare(seg, recipe: Recipe, host: _HostMask) -> None:
        cu_q, cu_k = host.offsets(recipe)
        if not (torch.equal(seg.cu_q.cpu(), cu_q) and torch.equal(seg.cu_k.cpu(), cu_k)):
            raise RuntimeError(
                "hf.graphed: an attention layer's padded layout differs from the one the host "
                f"computes from the call's attention_mask ({recipe}): the model changes the mask "
                "on its way to attention, which graph mode cannot re-plan from the host"
            )


class _MaskGraphStep(GraphStep):
    """Warm-up and capture of a bucket (and its CPU calls): graph-mode wrappers by recipe."""

    def __init__(self, owner: GraphedHFModel, entry: _Entry, layouts: _MaskLayouts):
        super().__init__(owner, entry)
        self.mask_layouts = layouts

    def offsets_key(self, cu_q, cu_k) -> Recipe:
        recipe = self.mask_layouts.recipe_of(cu_q, cu_k)
        if recipe is None:
            raise ValueError(
                "hf.graphed: an attention call's offsets do not come from the call's attention "
                "mask (hf.py's padded layout), so graph mode cannot re-plan them before a replay; "
                "graph mode takes models whose attention layers see the 2-D padding mask"
            )
        return recipe


class _MaskEagerStep(PlannedStep):
    """A CUDA call over every bucket: planned per recipe from the host mask, no read back."""

    def __init__(self, runtime: Runtime, layouts: _MaskLayouts):
        super().__init__(runtime, [])
        self.mask_layouts = layouts
        self._host_layouts: dict[Recipe, HostLayout] = {}

    def layout_for(self, cu_q, cu_k, total_q: int, total_k: int) -> HostLayout:
        recipe = self.mask_layouts.recipe_of(cu_q, cu_k)
        if recipe is None:
            return super().layout_for(cu_q, cu_k, total_q, total_k)
        layout = self._host_layouts.get(recipe)
        if layout is None:
            layout = self._host_layouts[recipe] = HostLayout(*self.mask_layouts.host.offsets(recipe))
        return layout


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """:data:`GRAPH_NAME`'s attention: ``hf.attention_forward`` outside graph mode; in
    a step of this module, the padded layout made on the device with no host read
    (recorded with its recipe), then the op."""
    layouts = getattr(current_step(), "mask_layouts", None)
    if layouts is None:
        return hf.attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    b, hq, sq, d = query.shape
    sk = key.shape[2]
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
            or tuple(attention_mask.shape) != (b, sk) or kwargs.get("cu_seq_lens_q") is not None
            or (causal and sq != sk)):
        got = None if attention_mask is None else tuple(getattr(attention_mask, "shape", ()))
        raise ValueError(
            f"hf.graphed: {type(module).__name__} got attention_mask of shape {got} for {sq} queries "
            f"and {sk} keys (causal={causal}); graph mode takes self-attention that sees the call's "
            f"2-D padding mask [batch, keys]"
        )
    reason = hf._reason(module, query, key, value, dropout, kwargs)
    window = kwargs.get("sliding_window")
    softcap, sinks = hf._variants(kwargs)
    if reason is None and window is not None and window < max(sq, sk):
        reason = hf.SHORT_WINDOW  # static: every padded row's queries span sq
    if reason is None and query.is_cuda and (softcap or sinks is not None):
        # graph plans take no variant (cudagraph.GraphStep): the model's own attention
        reason = hf.GRAPH_VARIANT
    if reason is not None:  # the model's eager attention on the padded mask: device work only
        return hf._stock(module, query, key, value, attention_mask, dropout, scaling, causal, kwargs, reason)
    seg = layouts.layout(attention_mask, sq, causal)
    q = query.transpose(1, 2).reshape(b * sq, hq, d)
    k, v = (t.transpose(1, 2).reshape(b * sk, t.shape[1], d) for t in (key, value))
    variants = {"softcap": softcap, "sinks": sinks} if softcap or sinks is not None else {}  # CPU: on the op
    out = ragged_attention(q, k, v, seg.cu_q, seg.cu_k, causal=causal, scale=scaling, **variants)
    return out.view(b, sq, hq, d), None


# -- the graphed model ---------------------------------------------------------------------


class _Entry:
    """Static inputs, wrappers, the captured graph and the output cuts of one bucket
    (and set of arguments)."""

    def __init__(self, bucket: PaddedBucket, specs: dict, flags: dict, device):
        self.bucket = bucket
        self.flags = flags
        self.fills = {name: fill for name, (_, _, fill) in specs.items()}
        with torch.inference_mode(False):  # written in place by calls in and out of inference mode
            self.inputs = {
                name: torch.full((bucket.batch, bucket.length) + trail, fill, dtype=dtype, device=device)
                for name, (dtype, trail, fill) in specs.items()
            }
        self.slots: dict[tuple, object] = {}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None
        self.host: _HostMask | None = None  # the current call's mask
        self.captured: _MaskLayouts | None = None  # the capture's layouts (rewritten by each replay)
        self.cuts = None  # (output tree spec, per leaf: which dims are "batch" / "length")

    def kwargs(self) -> dict:
        return {**self.inputs, **self.flags}


def _max_length(config) -> int | None:
    """The longest row the model's positions take, if it has a limit."""
    limit = getattr(config, "max_position_embeddings", None)
    family = hf_unpad.FAMILIES.get(getattr(config, "model_type", None))
    if limit is not None and family is not None and family.positions == "padding_idx":
        limit -= (getattr(config, "pad_token_id", None) or 0) + 1  # RoBERTa: positions start past padding_idx
    return limit


class GraphedHFModel(GraphOwner):
    """A transformers model under CUDA graphs over (batch, length) buckets; see the
    module docstring. Call it as the model. ``stats`` counts ``captures``,
    ``replays`` (CPU: calls on the static buffers), ``eager`` (calls over every
    bucket), ``fallbacks`` (calls graph mode does not take), ``syncs`` (masks read
    from the device), ``plans`` and ``waits``."""

    def __init__(self, model, buckets=None, *, runtime: Runtime | None = None, split_kv="auto"):
        from transformers import PreTrainedModel

        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise TypeError(
                "hf.graphed takes an eager model: pass the module itself (model._orig_mod), "
                "not its torch.compile wrapper"
            )
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"hf.graphed takes a transformers PreTrainedModel, got {type(model).__name__}")
        if hf_unpad.is_unpadded(model):
            raise ValueError(
                "this model runs padded calls packed (hf.unpad); graph mode pads them to buckets: "
                "use one of the two (hf.unpad(model, enabled=False) undoes unpad)"
            )
        if isinstance(model.__dict__.get("forward"), GraphedHFModel):
            raise ValueError("this model's forward is already a graphed model")
        from transformers import PreTrainedModel

        lacking = sorted({type(m).__name__ for m in model.modules()
                          if isinstance(m, PreTrainedModel) and not getattr(type(m), "_supports_flash_attn", False)})
        if lacking:
            # graph mode hands attention FlashAttention's 2-D padding mask and takes
            # causality from the modules: models that do not declare that contract may
            # rework the mask or lack is_causal
            raise ValueError(
                f"hf.graphed runs models that declare FlashAttention support; {', '.join(lacking)} do(es) not "
                "(_supports_flash_attn is false): call the model without hf.graphed (hf.register() still puts "
                "its attention on our op where its mask allows)"
            )
        device = model.device
        if runtime is None:
            runtime = get_runtime(device)
        super().__init__(runtime, split_kv, how="ragged_compile.hf.graphed(model, runtime=rc.Runtime(device))")
        if runtime.device != device:
            raise ValueError(f"the model is on {device} but the runtime serves {runtime.device}")
        self.model = model
        self.device = device
        self._forward = model.forward  # the model's own, also once model.forward is this object
        self.__signature__ = inspect.signature(self._forward)
        params = self.__signature__.parameters.values()
        self._params = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._use_cache = "use_cache" in self.__signature__.parameters
        limit = _max_length(model.config)
        self.buckets = default_padded_buckets(limit) if buckets is None else as_padded_buckets(buckets)
        longest = max(b.length for b in self.buckets)
        if limit is not None and longest > limit:
            raise ValueError(f"a bucket of length {longest} exceeds the {limit} positions {type(model).__name__} takes")
        self.pad_id = getattr(model.config, "pad_token_id", None) or 0
        self.entries: dict[tuple, _Entry] = {}
        if model.config._attn_implementation != GRAPH_NAME:
            before = model.config._attn_implementation
            model.set_attn_implementation(register())
            log.info("ragged_compile.hf.graphed: %s attn_implementation %r -> %r", type(model).__name__, before, GRAPH_NAME)

    # -- a call -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        call = self._bind(args, kwargs)
        reason = self._reason(call)
        if reason is not None:
            warn_once(f"hf.graphed: {reason}: {type(self.model).__name__} runs eagerly for such calls")
            self.stats["fallbacks"] += 1
            return self._eager(call)
        ref = call.get("input_ids", call.get("inputs_embeds"))
        b, s = ref.shape[:2]
        mask = call.get("attention_mask")
        if mask is None:
            valid = torch.ones(b, s, dtype=torch.bool)
        elif mask.device.type == "cpu":
            valid = mask != 0
        else:
            valid = (mask != 0).cpu()  # the one host read
            self.stats["syncs"] += 1
        start, n, one_run = hf._is_padding(valid, s, False)
        if not bool(one_run):
            warn_once(f"hf.graphed: valid tokens are not one run per row: {type(self.model).__name__} runs eagerly for such calls")
            self.stats["fallbacks"] += 1
            return self._eager(call)
        bucket = choose_bucket(self.buckets, b, s) if b and s else None
        if bucket is None:
            self.stats["eager"] += 1
            return self._eager(call, _HostMask(start, n))
        rows = (0, bucket.batch - b)  # padding rows: no valid token (run start 0, count 0)
        host = _HostMask(F.pad(start, rows), F.pad(n, rows))
        flags = {k: v for k, v in call.items() if not isinstance(v, torch.Tensor)}
        if self._use_cache:
            flags["use_cache"] = False
        names = tuple(sorted({k for k, v in call.items() if isinstance(v, torch.Tensor)} | {"attention_mask"}))
        key = (bucket, names, tuple(sorted(flags.items())))
        entry = self.entries.get(key)
        if entry is None:
            entry = self._capture(key, call, flags, names, host, b, s)
        self._load(entry, call, host, b, s)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.out
            if debug_checks():
                entry.captured.compare_all(host)
        else:  # CPU: the same buffers and bookkeeping, no graph
            out = self._run(entry, _MaskLayouts(host, check=True))
        self.stats["replays"] += 1
        if entry.cuts is None:
            entry.cuts = self._cuts(entry, out)
        return _cut(out, entry.cuts, b, s)

    def _bind(self, args, kwargs) -> dict:
        if len(args) > len(self._params):
            raise TypeError(f"forward takes {len(self._params)} positional arguments, {len(args)} given")
        call = dict(zip(self._params, args))
        for name, value in kwargs.items():
            if name in call:
                raise TypeError(f"forward got multiple values for argument {name!r}")
            call[name] = value
        return {k: v for k, v in call.items() if v is not None}  # None: the model's default

    def _reason(self, call: dict) -> str | None:
        """Why graph mode does not take this call (it runs eagerly), or None."""
        if self.model.training:
            return "the model is in training mode"
        ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
        if (ids is None) == (embeds is None):
            return "not exactly one of input_ids and inputs_embeds"
        ref = ids if ids is not None else embeds
        if ref.dim() != (2 if ids is not None else 3):
            return f"{'input_ids' if ids is not None else 'inputs_embeds'} of shape {tuple(ref.shape)}"
        b, s = ref.shape[:2]
        for k, v in call.items():
            if isinstance(v, torch.Tensor):
                if k not in _INPUTS:
                    return f"tensor argument {k!r}"
                if v.device.type != "cpu" and v.device != self.device:
                    return f"{k} on {v.device}"
                rows = (b,) if k == "attention_mask" else (1, b)
                if k not in ("input_ids", "inputs_embeds") and (v.dim() != 2 or v.shape[-1] != s or v.shape[0] not in rows):
                    return f"{k} of shape {tuple(v.shape)}"
            elif k in ("use_cache", "output_attentions") and v:
                return f"{k}=True"
            elif not isinstance(v, _FLAG_TYPES):
                return f"argument {k!r} of type {type(v).__name__}"
        return None

    def _eager(self, call: dict, host: _HostMask | None = None):
        """The model as given, under no_grad. ``host``: the mask, already read, which
        a CUDA call plans from (no second read)."""
        call = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        with torch.no_grad():
            if host is None or self.device.type != "cuda":
                return self._forward(**call)
            if "attention_mask" not in call:
                shape = call.get("input_ids", call.get("inputs_embeds")).shape[:2]
                call["attention_mask"] = torch.ones(shape, dtype=torch.long, device=self.device)
            layouts = _MaskLayouts(host, check=debug_checks())
            with self.runtime.run_step(_MaskEagerStep(self.runtime, layouts)):
                return self._forward(**call)

    # -- pieces ---------------------------------------------------------------------
    def _specs(self, call: dict, names) -> dict:
        """(dtype, trailing shape, padding value) of each static input."""
        specs = {}
        for name in names:
            x = call.get(name)
            dtype = torch.long if x is None else x.dtype
            trail = () if x is None else tuple(x.shape[2:])
            specs[name] = (dtype, trail, self.pad_id if name == "input_ids" else 0)
        return specs

    def _load(self, e: _Entry, call: dict, host: _HostMask, b: int, s: int) -> None:
        """The call's inputs into the static buffers and its layouts into every
        wrapper, outside any graph: the re-plan before a replay."""
        exact = (b, s) == (e.bucket.batch, e.bucket.length)
        for name, buf in e.inputs.items():
            x = call.get(name)
            if x is None:  # no attention_mask: every token is valid
                x = torch.ones(b, s, dtype=buf.dtype)
            x = x.expand((b, s) + tuple(x.shape[2:]))  # [1, S] position / token type ids
            if x.device == buf.device:
                if not exact:
                    buf.fill_(e.fills[name])
                buf[:b, :s].copy_(x)
            else:  # a CPU input into a CUDA buffer: padded on the host, one copy
                h = torch.full(buf.shape, e.fills[name], dtype=buf.dtype)
                h[:b, :s] = x
                buf.copy_(h.pin_memory(), non_blocking=True)
        e.host = host
        for (recipe, _), slot in e.slots.items():
            self.plan(slot, *host.offsets(recipe))

    def _run(self, e: _Entry, layouts: _MaskLayouts):
        with torch.no_grad(), activate(_MaskGraphStep(self, e, layouts)):
            return self._forward(**e.kwargs())

    def _new_slot(self, e: _Entry, recipe: Recipe, config):
        cu_q, cu_k = e.host.offsets(recipe)
        slot = self.make_slot(
            recipe, config, sequences=e.bucket.batch, segments=cu_q.numel() - 1,
            rows_q=int(cu_q[-1]), rows_k=int(cu_k[-1]), device=self.device,
        )
        self.plan(slot, cu_q, cu_k)
        e.slots[(recipe, config)] = slot
        return slot

    def _capture(self, key, call, flags, names, host: _HostMask, b: int, s: int) -> _Entry:
        e = _Entry(key[0], self._specs(call, names), flags, self.device)
        self._load(e, call, host, b, s)
        if self.device.type == "cuda":
            made = []

            def forward():
                made.append(_MaskLayouts(e.host, check=True))  # checked in the warm-ups
                return self._run(e, made[-1])

            try:
                e.graph, e.out = self.capture(forward)
            except RuntimeError as err:
                raise RuntimeError(
                    f"hf.graphed: {type(self.model).__name__} could not be captured into a CUDA graph ({err}). "
                    "A layer that copies between host and device or reads device values (nonzero, .item(), "
                    "grouped matmuls with host offsets: for MoE models try model.set_experts_implementation("
                    "'batched_mm')) cannot be captured; call the model without hf.graphed instead"
                ) from err
            e.captured = made[-1]
        self.entries[key] = e  # only once captured: a failed capture leaves no half-built entry
        return e

    def _cuts(self, e: _Entry, out):
        """Which dims of each output tensor run over the batch and the length: an
        eager probe of another (batch, length) shows which sizes follow the bucket's."""
        bb, lb = e.bucket.batch, e.bucket.length
        bp = 1 if bb != 1 else 2
        lp = 3 if lb != 3 else 4
        probe = {}
        for name, buf in e.inputs.items():
            probe[name] = torch.full((bp, lp) + tuple(buf.shape[2:]), 1 if name == "attention_mask" else e.fills[name],
                                     dtype=buf.dtype, device=buf.device)
        with torch.no_grad():
            small = self._forward(**probe, **e.flags)
        leaves, spec = pytree.tree_flatten(out)
        small_leaves, small_spec = pytree.tree_flatten(small)
        if spec != small_spec:
            raise RuntimeError(
                f"hf.graphed: {type(self.model).__name__} returns outputs of another structure for "
                f"another batch shape; graph mode cannot tell which rows are the caller's"
            )
        dims = []
        for big, little in zip(leaves, small_leaves):
            if not isinstance(big, torch.Tensor):
                dims.append(None)
                continue
            kinds = {(bb, bp): "batch", (lb, lp): "length"}
            dims.append(tuple(kinds.get((n, m)) for n, m in zip(big.shape, little.shape)))
        return spec, dims


def _cut(out, cuts, b: int, s: int):
    """The caller's rows and columns of every output tensor, copied (a replay
    overwrites the static output)."""
    spec, dims = cuts
    size = {"batch": b, "length": s}
    leaves = []
    for leaf, kinds in zip(pytree.tree_leaves(out), dims):
        if kinds is not None:
            leaf = leaf[tuple(slice(None) if k is None else slice(0, size[k]) for k in kinds)].clone()
        leaves.append(leaf)
    return pytree.tree_unflatten(leaves, spec)
