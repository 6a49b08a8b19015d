"""Hugging Face transformers models on the ragged op, unmodified.

One line::

    model.set_attn_implementation(ragged_compile.hf.register())
    # or AutoModel.from_pretrained(path, attn_implementation=ragged_compile.hf.register())

What runs on ``ragged_compile::ragged_attention`` (one call per layer):

* padded batches: 2-D padding masks (right or left), and 4-D masks that check
  out as padding plus optional causal. The padded ``[B, S]`` tensors are not
  gathered: each row becomes segments ``[padding | tokens | padding]`` whose
  padding segments see no key (padded query rows come back as zeros) or, for
  non-causal and cross-attention, every query row sees the row's valid keys.
  The layout is device arithmetic of static shape, so it compiles. Eager on
  CUDA, a small non-causal batch (``select.padded_kernel``) runs SDPA with the
  key-padding mask instead, in inference and training, reading nothing to the
  host (see ``_dense_padded``), and rows that pad nothing (no mask and no
  packing, or a mask read that pads nothing) run SDPA without a mask, as stock
  does (``select.full_rows_kernel``);
* packed batches: ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening``),
  or ``position_ids`` restarts when there is no mask;
* cross-attention with a key padding mask; decoding with a KV cache (our causal
  is bottom-right aligned, which is what a cache needs);
* vision/audio towers with ``cu_seqlens`` (see hf_towers.py);
* the variants the models pass: ``sliding_window`` (Mistral, Phi3, Qwen2 with
  ``use_sliding_window``, Gemma2/3 and gpt-oss sliding layers: ``(W - 1, 0)``;
  ModernBERT's local layers, bidirectional: ``(W - 1, W - 1)``), ``softcap``
  (Gemma2's ``attn_logit_softcapping``: the call's ``softcap``, which is what
  the model's own eager path applies) and ``s_aux`` (gpt-oss' sinks, with their
  gradient). On CUDA, where the op would run its reference kernel for a
  variant (select.py), the call takes the model's own path instead.

Everything else runs the model's own reference path on the same call, its
module's ``eager_attention_forward`` (which takes every argument the call
carries: softcap, sinks, dropout, attention weights), never transformers' SDPA
function, which drops some; logged once per reason at WARNING on the
"ragged_compile" logger (see :data:`FALLBACKS`). Model classes that are not on
transformers' attention interface (Falcon, MPNet, DeBERTa-v2) keep their own
attention when our name is set (from_config, from_pretrained: the implementation
transformers picks by default; set_attn_implementation: the one they have), said
once at WARNING naming the class.

``import ragged_compile`` does not import transformers; this module does.
"""

from __future__ import annotations

import functools

import sys
import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from . import hf_towers
from .backends import flash_backward
from .backends.select import WINDOW, full_rows_kernel, padded_kernel, unsupported_reason, variant
from .logs import warn_once
from .ops import autocast_inputs, ragged_attention
from .steps import current_step

__all__ = ["register", "attention_forward", "mask_function", "FALLBACKS", "SUPPORTED_VERSIONS", "unpad", "graphed"]

SUPPORTED_VERSIONS = ">=5.0,<6"

# Why a call runs the model's own attention instead of our op: each reason the code
# emits, once.
DROPOUT = "dropout in training"
POSITION_BIAS = "position_bias"
WINDOW_LAYOUT = "sliding window on a non-causal call with more keys than queries"
SHORT_WINDOW = "sliding window shorter than a sequence"  # graph mode's (hf_graphs.py): no window in a graph
GRAPH_VARIANT = "softcap or sinks in CUDA-graph mode"  # graph mode's: graph plans take no variant
NOT_RAGGED = "non-ragged attention mask"
COMPILED_4D_MASK = "4-D mask under torch.compile (checked for a ragged pattern only in eager)"
OUTPUT_ATTENTIONS = "output_attentions"
HEAD_DIMS_DIFFER = "value head dim differs from query head dim"
HEADS_NOT_GROUPED = "query heads are not a multiple of key/value heads"
UNSUPPORTED = "dtype / head dim / variant our op does not take fast on this device"
# Not a call's reason: a class whose attention never calls ours (said when our name is set).
OFF_INTERFACE = "model class not on transformers' attention interface"
# A kwarg of hf.unpad(..., buckets=True)'s packed calls: under torch.compile their
# attention runs a kernel CUDA graphs capture (flash_backward.in_graph).
IN_GRAPH = "ragged_compile_in_graph"

# The README's table of what falls back.
FALLBACKS = (
    DROPOUT, POSITION_BIAS, WINDOW_LAYOUT, SHORT_WINDOW, GRAPH_VARIANT, NOT_RAGGED, COMPILED_4D_MASK, OUTPUT_ATTENTIONS,
    HEAD_DIMS_DIFFER, HEADS_NOT_GROUPED, UNSUPPORTED, OFF_INTERFACE,
)

_registered: set[str] = set()
_register_lock = threading.Lock()


def register(name: str = "ragged") -> str:
    """Register our attention and mask functions with transformers under `name`.

    Idempotent; returns `name`, to pass as ``attn_implementation=``. The name
    must not contain "flash": transformers loads such names as FlashAttention
    hub kernels.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(
            f"name {name!r} contains 'flash': transformers treats such names as FlashAttention "
            f"hub kernels and fails at load; pick another, e.g. 'ragged'"
        )
    import transformers
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise RuntimeError(
            f"ragged_compile.hf supports transformers {SUPPORTED_VERSIONS}, found "
            f"{transformers.__version__}; install ragged-compile[transformers]"
        )
    with _register_lock:
        # Class methods: they write the global tables every model reads. Writing
        # through an instance, or skipping the mask, hands us attention_mask=None.
        AttentionInterface.register(name, attention_forward)
        AttentionMaskInterface.register(name, mask_function)
        hf_towers.install(name)
        _registered.add(name)
        _install_interface_check()
    return name


# -- classes off the attention interface ---------------------------------------------


def _class_reason(cls) -> str | None:
    """Why a model class keeps its own attention under our name, or None: its
    attention must call the attention interface (transformers' own test, which
    set_attn_implementation uses)."""
    try:
        on_interface = bool(cls._can_set_attn_implementation())
    except Exception:  # noqa: BLE001 - a class transformers cannot read: say so
        on_interface = False
    return None if on_interface else f"{OFF_INTERFACE} (its attention does not call ALL_ATTENTION_FUNCTIONS)"


# Configs of models that do not declare FlashAttention support -> (the config, the
# implementation whose mask they get).
_kept_masks: dict[int, tuple[weakref.ref, str | None, bool]] = {}  # (config, kind, from a parent)


def _note_mask_contract(model) -> None:
    """Our mask function hands FlashAttention's 2-D padding mask only to models that
    declare FlashAttention support. The others get the mask of the implementation
    transformers would give them (SDPA's, else eager's), which our attention function
    checks before running it on our op: their own layers may read the mask (Doge,
    BigBird-Pegasus' encoder) or their attention may lack ``is_causal`` (Splinter)."""
    config = getattr(model, "config", None)
    if config is None:
        return
    for key in [k for k, (ref, *_) in _kept_masks.items() if ref() is None]:
        del _kept_masks[key]
    kind = _mask_kind(type(model))
    for c, inherited in ((config, False), *((sub, True) for sub in _sub_configs(config))):
        entry = _kept_masks.get(id(c))
        if kind is None and entry is not None and entry[0]() is c and entry[2]:
            continue  # a composite model that declares no support refuses for its parts too (PaliGemma's text model)
        if kind is not None or not inherited:
            _kept_masks[id(c)] = (weakref.ref(c), kind, inherited)


def _sub_configs(config, depth: int = 0):
    from transformers import PretrainedConfig

    for value in vars(config).values():
        if isinstance(value, PretrainedConfig) and depth < 3:
            yield value
            yield from _sub_configs(value, depth + 1)


def _mask_kind(cls) -> str | None:
    if getattr(cls, "_supports_flash_attn", False):
        return None
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


@functools.cache
def _base_class_mask_kind(config_cls) -> str | None:
    # a config whose model was never seen setting our name (config._attn_implementation
    # written directly): its base model class answers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        return _mask_kind(MODEL_MAPPING[config_cls])
    except Exception:  # noqa: BLE001 - not an auto class (remote code): its own attention's mask
        return "sdpa"


def _kept_mask(config) -> str | None:
    """The implementation whose mask a model of ``config`` gets from our mask function,
    or None for FlashAttention's 2-D mask (only our eager name keeps them apart:
    graph mode refuses such models)."""
    if config is None or getattr(config, "_attn_implementation", None) not in _registered:
        return None
    entry = _kept_masks.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    return _base_class_mask_kind(type(config))


def _ours_requested(implementation) -> bool:
    if isinstance(implementation, dict):
        implementation = implementation.get("")
    return implementation in _registered


def _warn_kept(cls, reason, kept) -> None:
    warn_once(
        f"hf: {cls.__name__} is a {reason}: it keeps its own attention implementation ({kept!r}), "
        "and ragged_compile's op does not run in it"
    )


def _install_interface_check() -> None:
    """A class off the interface keeps its own attention when one of our names is set,
    said once at WARNING naming the class, the same way for from_config /
    from_pretrained (the model's __init__ checks its implementation: it gets the
    one transformers would pick by default) and set_attn_implementation (which
    transformers already refuses for such classes, on the model and its sub-models)."""
    from transformers import PreTrainedModel

    check = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(check, "_ragged_compile", False):
        return

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        reason = _class_reason(type(self)) if _ours_requested(attn_implementation) else None
        if reason is not None:
            kept = check(self, None, *args, **kwargs)  # Falcon would fail to build, MPNet to run
            _warn_kept(type(self), reason, kept)
            return kept
        if _ours_requested(attn_implementation):
            _note_mask_contract(self)
        return check(self, attn_implementation, *args, **kwargs)

    set_impl = PreTrainedModel.set_attn_implementation

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        result = set_impl(self, attn_implementation, *args, **kwargs)
        if _ours_requested(attn_implementation):
            for module in self.modules():
                if not isinstance(module, PreTrainedModel):
                    continue
                reason = _class_reason(type(module))
                if reason is not None:
                    _warn_kept(type(module), reason, module.config._attn_implementation)
                else:
                    _note_mask_contract(module)
        return result

    for new, old in ((_check_and_adjust_attn_implementation, check), (set_attn_implementation, set_impl)):
        new.__wrapped__, new.__doc__, new._ragged_compile = old, old.__doc__, True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation
    PreTrainedModel.set_attn_implementation = set_attn_implementation


# -- mask function ----------------------------------------------------------------


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """What our attention function gets as ``attention_mask``.

    As for FlashAttention: the 2-D key padding mask (None without padding),
    since padding, causality and packing are all the layout needs. Where a model
    overlays its own pattern (``use_vmap``: image tokens, blocks, prefixes) or a
    static cache makes the mask shorter than the keys, the full 4-D SDPA mask,
    which the attention function checks before running it on our op.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    kept = _kept_mask(kwargs.get("config"))
    if kept is not None:
        # never None (no padding): our attention then checks the pattern against the
        # module, which may not say is_causal
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return ALL_MASK_ATTENTION_FUNCTIONS[kept](
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, **kwargs,
        )
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
    if torch.compiler.is_compiling():
        # Dynamo cannot read closures: only the two plain patterns pass unmaterialised.
        from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

        plain = mask_function is None or mask_function is causal_mask_function or mask_function is bidirectional_mask_function
    else:
        plain = _layout_pattern(mask_function)
    needs_4d = (
        kwargs.get("use_vmap", False)
        or not plain
        or (attention_mask is not None and attention_mask.shape[-1] != kv_length)
        # a window our attention function would not hear of: the mask must carry it
        or (kwargs.get("local_size") is not None and not _attention_passes_window(kwargs.get("config")))
    )
    if needs_4d:
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("use_vmap", None)
        kw = dict(kwargs)
        if mask_function is not None:
            kw["mask_function"] = mask_function
        return sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, attention_mask=attention_mask, allow_is_causal_skip=False,
            use_vmap=True, **kw,
        )
    if attention_mask is not None:
        # The pattern, not the module, says whether the model's own attention is causal
        # (PegasusX builds its decoder self-attention without is_causal and a causal
        # mask): the attention function follows the mask, as eager attention does.
        # (Dynamo traces the attribute; under compile only the plain patterns get here.)
        if torch.compiler.is_compiling():
            from transformers.masking_utils import causal_mask_function

            attention_mask.ragged_compile_causal = mask_function is causal_mask_function
        else:
            attention_mask.ragged_compile_causal = _causal_pattern(mask_function)
    # A mask without padding is an ordinary layout (empty padding segments): telling
    # it apart here would cost a device-to-host read per forward.
    return attention_mask


def _pattern_names(fn, depth: int = 0):
    """The names of the mask patterns transformers composed ``fn`` from, outermost
    first (closures walked depth first); ``""`` for a walk deeper than 8."""
    if depth > 8:
        yield ""
        return
    yield getattr(fn, "__qualname__", "").split(".<locals>")[0]
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        for inner in value if isinstance(value, (tuple, list)) else (value,):
            if callable(inner) and not isinstance(inner, (torch.Tensor, type)):
                yield from _pattern_names(inner, depth + 1)


def _causal_pattern(fn) -> bool:
    """Whether a mask pattern transformers composed masks out future keys."""
    return fn is not None and any("causal" in name for name in _pattern_names(fn))


def _attention_passes_window(config) -> bool:
    """Whether the model's attention modules hand ``sliding_window`` to the attention
    function. Some build sliding-window masks and pass no window (PhiMoE,
    Qwen2-MoE with ``use_sliding_window``, Doge, PaliGemma): their eager attention
    gets the window from the mask alone, so the 2-D padding mask would drop it."""
    module = type(config).__module__.replace(".configuration_", ".modeling_") if config is not None else None
    return module is not None and _module_passes_window(module)


@functools.cache
def _module_passes_window(name: str) -> bool:
    import importlib
    import inspect

    try:
        return "sliding_window=" in inspect.getsource(importlib.import_module(name))
    except (ImportError, OSError, TypeError):  # no source to read: let the mask carry the window
        return False


# Mask patterns our layouts express (with the attention kwargs: sliding_window,
# position_ids / cu_seq_lens). Anything else (chunks, blocks, image-token or_masks,
# names a new transformers gives its helpers) gets the 4-D mask, checked before use.
_LAYOUT_PATTERNS = {
    "causal_mask_function", "bidirectional_mask_function", "and_masks", "sliding_window_overlay",
    "sliding_window_bidirectional_overlay", "sliding_window_causal_mask_function",
    "sliding_window_bidirectional_mask_function", "packed_sequence_mask_function",
    "remap_positions_for_packed_sequence", "padding_mask_function",
}


def _layout_pattern(fn) -> bool:
    """Whether transformers composed `fn` only from patterns a layout expresses."""
    return fn is None or all(name in _LAYOUT_PATTERNS for name in _pattern_names(fn))


# -- layouts ----------------------------------------------------------------------


class _Segments:
    """Offsets over the flattened ``[B * Sq]`` queries and ``[B * Sk]`` keys, and, where
    they were read once per forward, their host copies (``host_q``, ``host_k``)."""

    __slots__ = ("cu_q", "cu_k", "max_k", "ragged", "plain", "host_q", "host_k", "full", "__weakref__")

    def __init__(self, cu_q, cu_k, max_k=None, ragged=True, plain=False, host_q=None, host_k=None, full=False):
        self.cu_q, self.cu_k, self.max_k, self.ragged, self.plain = cu_q, cu_k, max_k, ragged, plain
        self.host_q, self.host_k = host_q, host_k
        self.full = full  # read from a 2-D mask that pads nothing (select.full_rows_kernel)

    def tell_runtime(self) -> None:
        """Give the CUDA runtime the host copies, so planning reads nothing back."""
        if self.host_q is not None and self.cu_q.is_cuda:
            from .runtime import get_runtime

            rt = get_runtime(self.cu_q.device)
            rt.know_offsets(self.cu_q, self.host_q)
            if self.cu_k is not self.cu_q:
                rt.know_offsets(self.cu_k, self.host_k)


def _cu(lengths) -> torch.Tensor:
    if isinstance(lengths, np.ndarray):  # host work (see _host_runs)
        return torch.from_numpy(np.concatenate(([0], np.cumsum(lengths.ravel()))).astype(np.int32))
    return F.pad(torch.cumsum(lengths.flatten(), 0, dtype=torch.int32), (1, 0))


def _runs(valid: torch.Tensor):
    """Start and count of the valid run of each row of a [B, S] bool mask."""
    n = valid.sum(-1)
    start = torch.where(n > 0, torch.argmax(valid.to(torch.int8), dim=-1), torch.zeros_like(n))
    return start, n


def _padded_layout(valid_k: torch.Tensor, sq: int, causal: bool) -> _Segments:
    """Segments per row without gathering: valid keys must form one run per row.

    Causal self-attention (Sq == Sk): [pad q | pad k | tokens | pad q | pad k], the
    padding segments see no key, so padded query rows are zeros. Otherwise every
    query row attends the row's valid run ([pad k | queries + run | pad k]);
    causal then aligns bottom-right, i.e. the queries are the run's last tokens.
    """
    start, n = _runs(valid_k)
    return _layout_of_runs(start, n, sq, valid_k.shape[-1], causal)


def _layout_of_runs(start, n, sq: int, sk: int, causal: bool) -> _Segments:
    """:func:`_padded_layout` from each row's run (start, count): tensors on the device,
    or numpy arrays of the same runs on the host, which give the same offsets."""
    xp = np if isinstance(n, np.ndarray) else torch
    end = start + n
    zero = xp.zeros_like(n)
    if causal and sq == sk:
        lq = xp.stack([start, zero, n, sq - end, zero], 1)
        lk = xp.stack([zero, start, n, zero, sk - end], 1)
    else:
        lq = xp.stack([zero, xp.full_like(n, sq), zero], 1)
        lk = xp.stack([start, n, sk - end], 1)
    return _Segments(_cu(lq), _cu(lk))


def _is_padding(valid_k: torch.Tensor, sq: int, causal: bool):
    """(start, count, ok) on the mask's device: each row's valid run, and whether the
    mask is padding (one run of valid keys per row; while decoding, causal, the run
    ends at the last key)."""
    start, n = _runs(valid_k)
    sk = valid_k.shape[-1]
    idx = torch.arange(sk, device=valid_k.device)
    inside = (idx >= start[:, None]) & (idx < (start + n)[:, None])
    ok = (inside == valid_k).all()
    if causal and sq != sk:
        ok = ok & ((start + n) == sk).all()  # padding after the keys while decoding
    return start, n, ok


def _host_runs(valid_k: np.ndarray, sq: int, causal: bool):
    """:func:`_is_padding` of a host copy of the mask, in numpy (torch's CPU ops cost
    microseconds each on arrays this small): ``(start, count)`` int64 arrays, or
    None where the mask is not padding."""
    n = valid_k.sum(-1)
    start = np.where(n > 0, valid_k.argmax(-1), 0)
    end = start + n
    idx = np.arange(valid_k.shape[-1])
    if not (((idx >= start[:, None]) & (idx < end[:, None])) == valid_k).all():
        return None
    if causal and sq != valid_k.shape[-1] and not (end == valid_k.shape[-1]).all():
        return None  # padding after the keys while decoding
    return start.astype(np.int64), n.astype(np.int64)


def _read_padded_layout(valid_k: torch.Tensor, sq: int, causal: bool) -> _Segments:
    """Eager: the padded layout of a 2-D mask, checked, with one host read per forward
    (the mask itself), so that the check and the runtime's planning read nothing else
    back. The runs, the check and the offsets are host work on that copy; the device
    offsets arrive in one copy, not as a dozen small kernels (the host decides a small
    batch's time). A mask that is not padding gives a non-ragged result."""
    runs = _host_runs(valid_k.to("cpu").numpy(), sq, causal)
    if runs is None:
        return _Segments(None, None, ragged=False)
    seg = _layout_of_runs(*runs, sq, valid_k.shape[-1], causal)
    seg.full = bool((runs[1] == valid_k.shape[-1]).all())
    if not valid_k.is_cuda:
        return seg
    both = torch.cat([seg.cu_q, seg.cu_k]).pin_memory().to(valid_k.device, non_blocking=True)
    m = seg.cu_q.shape[0]
    on_device = _Segments(both[:m], both[m:], host_q=seg.cu_q, host_k=seg.cu_k, full=seg.full)
    on_device.tell_runtime()
    return on_device


def _assert_padded(valid_k: torch.Tensor, sq: int, causal: bool) -> None:
    """The check of :func:`_read_padded_layout` for compiled code: no host read, an error
    at run time instead of a fallback (a graph cannot choose stock SDPA on the mask's
    values)."""
    _, _, ok = _is_padding(valid_k, sq, causal)
    torch._assert_async(
        ok, "ragged_compile.hf: attention_mask is not padding (one run of 1s per row) under "
        "torch.compile; run such masks eagerly or on attn_implementation='sdpa'",
    )


def _position_layout(position_ids: torch.Tensor, b: int, s: int, compiling: bool = True) -> _Segments:
    """Packed sequences start where positions do not continue (as transformers'
    find_packed_sequence_indices).

    Compiled: a static shape, one segment slot per token, unused slots empty, so
    new layouts never change shapes. Eager: the positions are read to the host
    (the one read of the forward: the runtime plans from that copy) and the
    offsets hold the real segments only; FlashAttention-2's grid has a block row
    per segment slot, at most 65,535."""
    device = position_ids.device
    pos = position_ids.expand(b, s).reshape(b, s)
    if not compiling:
        pos = pos.to("cpu")
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    t = b * s
    if not compiling:
        starts = torch.nonzero(start.reshape(t)).flatten().to(torch.int32)
        cu_host = torch.cat([starts, starts.new_full((1,), t)])
        cu = cu_host.to(device, non_blocking=True) if device.type == "cuda" else cu_host
        seg = _Segments(cu, cu, host_q=cu_host, host_k=cu_host)
        seg.tell_runtime()
        return seg
    idx = torch.arange(t, device=pos.device, dtype=torch.int32)
    starts = torch.where(start.reshape(t), idx, torch.full_like(idx, t))
    cu = torch.cat([torch.sort(starts).values, idx.new_full((1,), t)])
    return _Segments(cu, cu)


def _plain_layout(b: int, sq: int, sk: int, device) -> _Segments:
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
    cu_k = cu_q if sk == sq else torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=device)
    return _Segments(cu_q, cu_k, max_k=sk, plain=True)


def _check_4d(mask: torch.Tensor, b: int, sq: int, sk: int, causal: bool):
    """A 4-D mask as a key padding mask [B, Sk], if it is padding plus optional
    (bottom-right) causal on every row that is not itself padding; else None."""
    if mask.shape[0] not in (1, b) or mask.shape[-2] not in (1, sq) or mask.shape[-1] != sk:
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        if not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return None  # a bias, not a mask
        allowed = mask == 0
    else:
        return None
    if allowed.shape[1] != 1 and not bool((allowed == allowed[:, :1]).all()):
        return None
    a = allowed[:, 0].expand(b, sq, sk)
    valid = a.any(1)
    if not bool(_is_padding(valid, sq, False)[2]):
        return None
    start, n = _runs(valid)
    j = torch.arange(sk, device=mask.device)
    expected = valid[:, None, :].expand_as(a)
    rows = torch.ones(a.shape[:2], dtype=torch.bool, device=mask.device)
    if causal:
        r = torch.arange(sq, device=mask.device)
        last = (start + n)[:, None] - sq + r[None, :]  # bottom-right: row r sees keys <= last
        expected = expected & (j[None, None, :] <= last[:, :, None])
        if sq == sk:
            rows = valid  # padded query rows are ours to zero
    if not bool(((a == expected) | ~rows[:, :, None]).all()):
        return None
    return valid


# Layout cache: once per forward, keyed on the object every layer gets.
_cache: dict[int, tuple] = {}


def _cached(src, extra, build):
    if src is None or torch.compiler.is_compiling():
        return build()
    key = (id(src), extra)  # one entry per layout of a mask (layers of two kinds alternate)
    hit = _cache.get(key)
    # Inference tensors have no version counter: known by identity alone.
    version = src._version if isinstance(src, torch.Tensor) and not src.is_inference() else -1
    if hit is not None and hit[0]() is src and hit[1] == version and hit[2] == extra:
        return hit[3]
    value = build()
    _cache[key] = (weakref.ref(src, lambda _, k=key: _cache.pop(k, None)), version, extra, value)
    return value


_plain: dict[tuple, _Segments] = {}


def _plain_cached(b, sq, sk, device) -> _Segments:
    # The same offsets object for every layer (the CUDA runtime knows it by address).
    key = (b, sq, sk, device)
    hit = _plain.get(key)
    if hit is None:
        if len(_plain) > 64:
            _plain.clear()
        hit = _plain[key] = _plain_layout(b, sq, sk, device)
    return hit


# -- fallback -------------------------------------------------------------------

def _log_once(reason: str, module) -> None:
    warn_once(f"hf: {reason}: {type(module).__name__} runs the model's own (eager) attention for these calls")


def _dense_from_layout(layout: _Segments, b, sq, sk, causal, window, device) -> torch.Tensor:
    """[B, 1, Sq, Sk] bool mask of a layout, rows without keys all True."""
    def seg_pos(cu, t):
        idx = torch.arange(t, device=device)
        seg = torch.searchsorted(cu[1:].to(torch.int64), idx, right=True)
        return seg, idx - cu[seg]

    cu_q, cu_k = layout.cu_q.to(device), layout.cu_k.to(device)
    sq_id, qpos = seg_pos(cu_q, b * sq)
    sk_id, kpos = seg_pos(cu_k, b * sk)
    lq = (cu_q[1:] - cu_q[:-1])[sq_id]
    lk = (cu_k[1:] - cu_k[:-1])[sq_id]
    qpos = (qpos + lk - lq).view(b, sq, 1)  # bottom-right: in key coordinates
    kpos = kpos.view(b, 1, sk)
    allowed = sq_id.view(b, sq, 1) == sk_id.view(b, 1, sk)
    if causal:
        allowed = allowed & (kpos <= qpos)
    if window is not None:  # |q - k| < window, compared without a [Sq, Sk] integer tensor
        allowed = allowed & (kpos > qpos - window)
        if not causal:
            allowed = allowed & (kpos < qpos + window)
    empty = ~allowed.any(-1, keepdim=True)
    return (allowed | empty)[:, None], empty


def _eager_of(module):
    """The model's own reference attention: ``eager_attention_forward`` of the module
    that defines the attention class (what transformers runs for "eager"), else ours,
    which takes every argument transformers' attention calls carry."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else _eager_attention


def _eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                     s_aux=None, sinks=None, position_bias=None, **kwargs):
    """Dense attention with every argument the attention interface passes: GQA, an
    additive mask, scaling before the soft-cap (Gemma2), a position bias (T5),
    sinks in the denominator (gpt-oss), dropout in training, the weights returned.
    For attention modules whose module defines no ``eager_attention_forward``."""
    grp = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(grp, dim=1)
    v = value.repeat_interleave(grp, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : k.shape[-2]]
    sinks = s_aux if s_aux is not None else sinks
    if sinks is not None:
        col = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(scores.shape[0], -1, scores.shape[2], 1)
        weights = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights = F.dropout(weights.to(query.dtype), p=dropout, training=module.training)
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool (allowed) or additive mask as the additive float mask eager code adds."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _stock(module, query, key, value, attention_mask, dropout, scaling, causal, kwargs, reason, layout=None):
    """The call on the model's own eager attention, with the mask it would have built
    (padding, causal, window, packing), rows that see no key zero as on ours."""
    _log_once(reason, module)
    b, _, sq, _ = query.shape
    sk = key.shape[2]
    empty = None
    window = kwargs.get("sliding_window")
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask  # transformers built it: the window is in it
        if mask.shape[1] == 1:
            allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
            empty = ~allowed[:, 0].any(-1, keepdim=True).expand(b, sq, 1)
    elif attention_mask is not None and attention_mask.dim() == 2:
        valid = attention_mask.to(torch.bool)
        j = torch.arange(sk, device=query.device)
        mask = valid[:, None, :].expand(b, sq, sk)
        if causal:
            r = torch.arange(sq, device=query.device) + (sk - sq)
            mask = mask & (j[None, None, :] <= r[None, :, None])
        if window is not None:
            r = torch.arange(sq, device=query.device) + (sk - sq)
            dist = r[:, None] - j[None, :]
            mask = mask & ((dist < window) if causal else (dist.abs() < window))
        empty = ~mask.any(-1, keepdim=True)
        mask = (mask | empty)[:, None]
    elif layout is not None:
        mask, empty = _dense_from_layout(layout, b, sq, sk, causal, window, query.device)
    else:
        mask = attention_mask
    kw = {k: v for k, v in kwargs.items()
          if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal", IN_GRAPH)}
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mask = None if mask is None else _additive(mask, query.dtype)
    out, weights = _eager_of(module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kw)
    if empty is not None:
        out = out.masked_fill(empty[:, :, :, None], 0)  # rows that see no key: zeros, as ours
    return out, weights


# -- the attention function ---------------------------------------------------------


def _variants(kwargs) -> tuple[float, torch.Tensor | None]:
    """The call's softcap (0: none) and sinks (gpt-oss passes its sinks as ``s_aux``)."""
    sinks = kwargs.get("s_aux")
    return float(kwargs.get("softcap") or 0.0), kwargs.get("sinks") if sinks is None else sinks


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _dropout_p(module, dropout) -> float:
    """The attention dropout a call asks for: transformers passes the module's
    probability in training (and 0.0, or the probability, in eval)."""
    return float(dropout) if dropout and dropout > 0 and module.training else 0.0


def _in_graph(query, compiling: bool, kwargs) -> bool:
    """Whether a call runs :func:`flash_backward.in_graph`: a packed call of
    ``hf.unpad(..., buckets=True)`` under torch.compile (``query`` in the dtype the
    kernel gets) that aten's FlashAttention-2 takes, no softcap or sinks."""
    if not (compiling and kwargs.get(IN_GRAPH) and kwargs.get("max_length_q") is not None):
        return False
    softcap, sinks = _variants(kwargs)
    return softcap == 0.0 and sinks is None and \
        flash_backward.unsupported_reason(query.device, query.dtype, query.shape[-1]) is None


def _reason(module, query, key, value, dropout, kwargs, in_graph: bool = False) -> str | None:
    """Why the call runs the model's own attention, or None. ``in_graph``: it runs
    FlashAttention-2 in the graph, which needs no other kernel of the op."""
    if _dropout_p(module, dropout) and not in_graph:
        softcap, sinks = _variants(kwargs)
        why = unsupported_reason(query.device, query.dtype, query.shape[-1], dropout=True,
                                 variant=variant(False, softcap=softcap, sinks=sinks))
        if why is not None:
            return f"{DROPOUT} ({why})"
    if kwargs.get("position_bias") is not None:
        return POSITION_BIAS
    if kwargs.get("output_attentions"):
        return OUTPUT_ATTENTIONS
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return HEAD_DIMS_DIFFER
    if query.shape[1] % key.shape[1] != 0:
        return HEADS_NOT_GROUPED
    if in_graph:
        return None
    softcap, sinks = _variants(kwargs)
    # a call that needs gradients needs a fused backward too (none caps scores yet)
    why = unsupported_reason(query.device, query.dtype, query.shape[-1], training=_needs_grad(query, key, value),
                             variant=variant(False, softcap=softcap, sinks=sinks))
    if why is not None:
        return f"{UNSUPPORTED} ({why})"
    return None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers attention function: q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``
    (GQA not expanded) -> ``([B, Sq, Hq, D], None)``."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # a mask our mask function made says what the model's eager attention would do
    causal = bool(getattr(attention_mask, "ragged_compile_causal", causal))
    b, hq, sq, d = query.shape
    sk = key.shape[2]
    compiling = torch.compiler.is_compiling()
    # Under autocast our op takes q/k/v in autocast's dtype, as SDPA does (RoPE in
    # float32 hands it float32 q and k): decide on what the kernel will get.
    cast_q, cast_k, cast_v = autocast_inputs(query, key, value)
    in_graph = _in_graph(cast_q, compiling, kwargs)
    reason = _reason(module, cast_q, cast_k, cast_v, dropout, kwargs, in_graph)
    if reason is None and causal and sq > sk:
        reason = NOT_RAGGED  # more queries than keys: no cache alignment

    # Packing is known without the mask; stock SDPA needs it too (as a dense mask).
    cu_q = kwargs.get("cu_seq_lens_q")
    layout = None
    if cu_q is not None:
        if b != 1:
            raise ValueError(
                f"cu_seq_lens_q describes a packed batch, so the batch dim must be 1, got {b}; "
                f"pack the sequences along the sequence dim (DataCollatorWithFlattening does)"
            )
        cu_k = kwargs.get("cu_seq_lens_k")
        layout = _Segments(cu_q, cu_q if cu_k is None else cu_k, kwargs.get("max_length_k"))
    elif attention_mask is None:
        position_ids = kwargs.get("position_ids")
        if causal and sq == sk and position_ids is not None and position_ids.shape[-1] == sq:
            layout = _cached(position_ids, (b, sq), lambda: _position_layout(position_ids, b, sq, compiling))
        else:
            layout = _plain_layout(b, sq, sk, query.device) if compiling else _plain_cached(b, sq, sk, query.device)
    if reason is not None:
        return _stock(module, query, key, value, attention_mask, dropout, scaling, causal, kwargs, reason, layout)

    window = kwargs.get("sliding_window")
    dropout_p = _dropout_p(module, dropout)
    softcap, sinks = _variants(kwargs)
    if layout is None and _dense_padded(query, key, value, attention_mask, causal, window, dropout_p, softcap, sinks,
                                        compiling):
        # a small padded batch: SDPA with the key-padding mask, no mask read (select.padded_kernel)
        dense = _cached(attention_mask, ("dense", cast_q.dtype), lambda: _dense_mask(attention_mask, cast_q.dtype))
        out = F.scaled_dot_product_attention(cast_q, cast_k, cast_v, attn_mask=dense, dropout_p=dropout_p, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if layout is not None:
        pass  # packed, or no mask
    elif attention_mask.dim() == 2:
        # A window counts in key positions: non-causal, queries take the keys' layout
        # (padded query rows get no key: zeros), which needs as many queries as keys.
        aligned = causal or (window is not None and sq == sk)
        if attention_mask.shape != (b, sk):
            reason = NOT_RAGGED
        elif window is not None and not causal and sq != sk:
            reason = WINDOW_LAYOUT
        else:
            def build():  # the mask's bool copy too: once per forward, not per layer
                valid = attention_mask.to(torch.bool)
                if compiling:
                    _assert_padded(valid, sq, aligned)
                    return _padded_layout(valid, sq, aligned)
                return _read_padded_layout(valid, sq, aligned)

            layout = _cached(attention_mask, (sq, aligned), build)
            if not layout.ragged:
                reason, layout = NOT_RAGGED, None
    elif attention_mask.dim() == 4 and not compiling:
        def build4():
            valid = _check_4d(attention_mask, b, sq, sk, causal)
            return _Segments(None, None, ragged=False) if valid is None else _padded_layout(valid, sq, causal)

        layout = _cached(attention_mask, (sq, sk, causal), build4)
        window = None  # transformers built the mask with its window: a pattern that passes holds it
        if not layout.ragged:
            reason, layout = NOT_RAGGED, None
    elif attention_mask.dim() == 4:
        reason = COMPILED_4D_MASK
    else:
        reason = NOT_RAGGED
    if reason is None and _dense_full(layout, query, key, causal, window, softcap, sinks, compiling):
        # nothing is padded: the dense kernel, without a mask, as stock runs it
        out = F.scaled_dot_product_attention(cast_q, cast_k, cast_v, dropout_p=dropout_p,
                                             is_causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    window_size = (-1, -1)
    if reason is None and window is not None:
        # transformers' sliding_window W: a key within W - 1 positions (both sides if
        # bidirectional: ModernBERT passes half its local_attention + 1).
        window_size = (window - 1, 0 if causal else window - 1)
        why = unsupported_reason(query.device, cast_q.dtype, d, training=_needs_grad(query, key, value),
                                 variant=(WINDOW,))
        if why is not None:  # a CUDA window runs the reference: only where it changes nothing
            if _window_covers(layout, window, compiling):
                window_size = (-1, -1)
            else:
                reason = f"{UNSUPPORTED} ({why})"
    if reason is None and dropout_p and window_size != (-1, -1):
        reason = f"{DROPOUT} (with a sliding window: no kernel takes both)"
    if reason is not None:
        return _stock(module, query, key, value, attention_mask, dropout, scaling, causal, kwargs, reason, layout)

    q = cast_q.transpose(1, 2).reshape(b * sq, hq, d)
    k = cast_k.transpose(1, 2).reshape(b * sk, key.shape[1], d)
    v = cast_v.transpose(1, 2).reshape(b * sk, value.shape[1], d)
    if in_graph and layout.max_k is not None:
        # hf.unpad(..., buckets=True) under torch.compile: a kernel that CUDA graphs can
        # capture (it reads the offsets on the device), so reduce-overhead's graphs hold
        # the attention too and a replay serves every layout of the bucket (and batch size).
        out = flash_backward.in_graph(q, k, v, layout.cu_q, layout.cu_k, kwargs["max_length_q"], layout.max_k,
                                      causal, scaling, window_size, dropout_p)
        return out.reshape(b, sq, hq, d), None
    if query.device.type == "cuda" and not compiling and (layout.cu_q.is_inference() or layout.cu_k.is_inference()):
        # The runtime reuses a plan across layers while the offsets tensor is alive
        # and unmodified (its implicit step: address and version); inference tensors
        # have no version. A plain copy, once per forward where the layout is cached.
        layout = _cached(layout.cu_q, ("plain", id(layout.cu_k)), lambda: _plain_copy(layout))
    out = ragged_attention(q, k, v, layout.cu_q, layout.cu_k, causal=causal, scale=scaling, window_size=window_size,
                           softcap=softcap, sinks=sinks, dropout_p=dropout_p)
    return out.view(b, sq, hq, d), None


def _dense_padded(query, key, value, attention_mask, causal, window, dropout_p, softcap, sinks, compiling) -> bool:
    """Whether a call runs :func:`select.padded_kernel`'s ``"sdpa"``: an eager CUDA
    call, inference or training (its dropout is SDPA's, as stock's is), not
    causal, on a 2-D key padding mask, no window, soft-cap or sinks (see
    :func:`_dense_may_run`), and small. Not with GQA: SDPA's
    ``enable_gqa`` with a mask leaves its fused kernels."""
    if compiling or attention_mask is None or attention_mask.dim() != 2 or causal or window is not None:
        return False
    b, hq, sq, d = query.shape
    if attention_mask.shape != (b, key.shape[2]) or key.shape[1] != hq or not query.is_cuda:
        return False
    if softcap or sinks is not None or not _dense_may_run():
        return False
    return padded_kernel(b, sq, key.shape[2], hq, d, causal) == "sdpa"


def _dense_full(layout, query, key, causal, window, softcap, sinks, compiling) -> bool:
    """Whether a call runs :func:`select.full_rows_kernel`'s ``"sdpa"``: an eager CUDA
    call on rows that pad nothing (no mask and no packing, or a 2-D mask read once
    per forward and found full), no window, soft-cap or sinks (see
    :func:`_dense_may_run`)."""
    if compiling or layout is None or not (layout.full or layout.plain) or not query.is_cuda:
        return False
    if window is not None or softcap or sinks is not None or not _dense_may_run():
        return False
    return full_rows_kernel(query.shape[1], key.shape[1], query.shape[2], key.shape[2], causal) == "sdpa"


def _dense_may_run() -> bool:
    """Whether the dense SDPA routes may take a call: not inside a runtime step (a
    step asked for plans; graph mode replays one capture across layouts), and not
    under saved-tensor hooks. Non-reentrant checkpointing (transformers' default)
    recomputes a layer under such hooks in the backward, where no step is active
    (steps are per thread), and checks that the recompute saves what the forward
    saved: the op both times, so a forward inside a step and its recompute agree."""
    return current_step() is None and torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _dense_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[B, 1, 1, Sk]`` additive mask (0 or -inf, in q's dtype) SDPA broadcasts,
    built once per forward: SDPA converts a bool mask to this at every call (two
    kernels and ~35 us of host time a layer on the H200, where stock passes one).
    A row with no valid key sees every key instead (finite values at positions
    that are all padding, where the ragged path writes zeros), as SDPA would give
    NaN there."""
    valid = attention_mask.to(torch.bool)
    valid = (valid | ~valid.any(-1, keepdim=True))[:, None, None, :]
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def _plain_copy(layout: _Segments) -> _Segments:
    with torch.inference_mode(False):
        cu_q = layout.cu_q.clone()
        cu_k = cu_q if layout.cu_k is layout.cu_q else layout.cu_k.clone()
    seg = _Segments(cu_q, cu_k, layout.max_k, host_q=layout.host_q, host_k=layout.host_k)
    seg.tell_runtime()
    return seg


def _window_covers(layout: _Segments, window: int, compiling: bool) -> bool:
    """Whether a sliding window spans every segment's keys (then it changes nothing)."""
    if layout.max_k is not None and not isinstance(layout.max_k, torch.Tensor):
        return int(layout.max_k) <= window
    if compiling:
        return False  # would need the lengths on the host
    cu_q, cu_k = (layout.host_q, layout.host_k) if layout.host_q is not None else (layout.cu_q, layout.cu_k)
    lk = cu_k[1:] - cu_k[:-1]
    lq = cu_q[1:] - cu_q[:-1]
    return bool((torch.maximum(lk, lq) <= window).all())


from .hf_unpad import unpad  # noqa: E402  (padded calls as one packed row; see hf_unpad.py)
from .hf_graphs import graphed  # noqa: E402  (CUDA graphs over (batch, length) buckets; see hf_graphs.py)
