"""Padded batches into transformers models as one packed row: ``unpad(model)``.

One line, after which a padded call (``tokenizer(texts, padding=True)``) costs the
valid tokens only::

    ragged_compile.hf.unpad(model)            # sets attn_implementation to register()'s name
    out = model(input_ids=ids, attention_mask=mask)   # padded in, padded out

For a call with a 2-D padding ``attention_mask`` (right or left padding) the
valid tokens of ``input_ids`` / ``inputs_embeds`` / ``token_type_ids`` are
gathered into one row ``[1, T]`` with the position ids the model would have
used, the model runs packed (``cu_seq_lens_q/k`` kwargs: one
``ragged_compile::ragged_attention`` call per layer, no compute on padding),
and its outputs come back in the caller's ``[B, S, ...]`` shape with zeros at
padded positions. Heads run on those padded outputs.

The mask is read on the host once per forward (the packed total must be known:
one device-to-host copy of the row lengths and a few checks). That read waits for
the GPU's queued work. A mask passed on the CPU with the inputs on the GPU needs
no read: the host packs the next batch while the GPU still runs the last one's
work (what a training loop wants). Everything else is
device arithmetic, nothing per layer, and on CUDA the runtime plans from the host
offsets of that read (``Runtime.know_offsets``). Llama and Mistral build their
causal mask themselves, so transformers reads the packed position ids once more
(``find_packed_sequence_indices``). Under ``torch.compile`` the read and the
scatter back to ``[B, S, ...]`` are graph breaks, so the compiled packed model
never sees the caller's padded width; the packed dim is marked dynamic, so after
the recompile that new widths cause anyway, one graph serves every total.

Calls it cannot pack exactly run the ordinary padded call (on our attention,
see :mod:`ragged_compile.hf`), logged once per reason and class at WARNING on
the "ragged_compile" logger (:data:`FALLBACKS`). A call without padding skips
packing silently.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from .backends import flash_backward, select
from .logs import log, warn_once

__all__ = ["unpad", "is_unpadded", "FALLBACKS", "FAMILIES"]

IGNORE_INDEX = -100  # transformers' losses ignore these labels

# Reasons a call runs the padded model instead (README table).
FALLBACKS = (
    "unknown model class",
    "attention implementation is not ours",
    "use_cache / past_key_values",
    "output_attentions",
    "attention dropout in training",
    "decoder / cross-attention config",
    "attention_mask is not a 2-D padding mask",
    "valid tokens are not one run per row",
    "head reads a padded position",
    "labels at padded positions",
    "sliding window shorter than a sequence",
    "per-token input unpad does not know",
)


@dataclass(frozen=True)
class _Head:
    """What a head reads of the base model's padded outputs.

    reads: "tokens" (each valid position, or the mask itself), "first" (position 0
    of every row: BERT's pooler, [CLS] classifiers), "last_non_pad" (the last
    token that is not ``pad_token_id``: decoders' sequence classification).
    per_token: output fields of shape [B, S, ...] (zeroed at padded positions).
    labels: how ``labels`` reach logits: None (not per token, or the loss masks
    them itself), "tokens" (label t scores logit t), "shifted" (label t + 1).
    """

    reads: str = "tokens"
    per_token: tuple = ()
    labels: str | None = None


@dataclass(frozen=True)
class _Family:
    prefix: str            # class-name prefix in transformers ("Bert", "XLMRoberta")
    # Position ids of a token when the caller passes none, as the model computes them on
    # the padded batch: "column" (its index in the padded row: BERT's buffer, Llama's
    # arange(S), also under left padding), "padding_idx" (RoBERTa: padding_idx + 1 + the
    # count of non-pad tokens before it).
    positions: str
    causal: bool = False
    dropout: tuple = ("attention_probs_dropout_prob",)  # config fields of the attention dropout
    heads: dict = field(default_factory=dict)
    # The model takes a {layer type: mask} mapping for attention_mask: the packed call
    # passes None for each, so transformers builds no mask and, without one, does not
    # read the position ids back to find packed sequences (find_packed_sequence_indices).
    mask_mapping: bool = False


_TOKENS = _Head("tokens", ("logits",), "tokens")
_FIRST = _Head("first")
_ENCODER_HEADS = {"ForMaskedLM": _TOKENS, "ForTokenClassification": _TOKENS, "ForSequenceClassification": _FIRST}
_DECODER_HEADS = {
    "ForCausalLM": _Head("tokens", ("logits",), "shifted"),
    "ForTokenClassification": _TOKENS,
    "ForSequenceClassification": _Head("last_non_pad"),
}

# model_type -> family. Classes are matched by exact name within transformers'
# own modules, so remote code and subclasses with other forwards are "unknown".
FAMILIES = {
    "bert": _Family("Bert", "column", heads={
        **_ENCODER_HEADS, "ForPreTraining": _Head("first", ("prediction_logits",), "tokens"),
        "ForNextSentencePrediction": _FIRST}),
    "roberta": _Family("Roberta", "padding_idx", heads=_ENCODER_HEADS),
    "xlm-roberta": _Family("XLMRoberta", "padding_idx", heads=_ENCODER_HEADS),
    # ElectraForPreTraining's loss selects the positions where attention_mask == 1.
    "electra": _Family("Electra", "column", heads={**_ENCODER_HEADS, "ForPreTraining": _Head("tokens", ("logits",))}),
    "distilbert": _Family("DistilBert", "column", dropout=("attention_dropout",), heads=_ENCODER_HEADS),
    # ForSequenceClassification: "cls" pooling reads position 0, "mean" pools with the mask (_family_of).
    "modernbert": _Family("ModernBert", "column", dropout=("attention_dropout",), heads=_ENCODER_HEADS),
    "llama": _Family("Llama", "column", True, ("attention_dropout",), _DECODER_HEADS),
    "mistral": _Family("Mistral", "column", True, ("attention_dropout",), _DECODER_HEADS),
    "qwen2": _Family("Qwen2", "column", True, ("attention_dropout",), _DECODER_HEADS, mask_mapping=True),
    "qwen3": _Family("Qwen3", "column", True, ("attention_dropout",), _DECODER_HEADS, mask_mapping=True),
}

# Inputs gathered with the tokens; every other per-token tensor falls back.
_PACKED_INPUTS = ("input_ids", "inputs_embeds", "token_type_ids", "position_ids")
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_KNOWN_OFFSETS_DEVICES = ("cuda",)  # where the op plans from host offsets (runtime.py)
_CTX = "_ragged_unpad"  # private kwarg our top-level wrapper hands the head's base-model call


def _attention_dtype_and_head_dim(base, config, ref):
    """The dtype the attention will compute in (autocast's where on) and the head dim."""
    kind = ref.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else next(base.parameters()).dtype
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
    dim = getattr(config, "hidden_size", None) or getattr(config, "dim", None)
    return dtype, getattr(config, "head_dim", None) or (dim // heads if dim and heads else None)


def _dropout_runs_on_op(base, config, ref) -> bool:
    """Whether the op takes this model's attention dropout (FlashAttention-2 on CUDA,
    in the dtype the attention will compute in)."""
    if not isinstance(ref, torch.Tensor) or ref.device.type != "cuda":
        return False
    dtype, head_dim = _attention_dtype_and_head_dim(base, config, ref)
    return head_dim is not None and select.dropout_kernel(ref.device, dtype, head_dim) == "fa2"


def _window_runs_on_op(base, config, ref) -> bool:
    """Whether the op's kernels take a sliding window here (the fused CPU kernel;
    FlashAttention-2 on CUDA), so packed windowed layers stay fast."""
    dtype, head_dim = _attention_dtype_and_head_dim(base, config, ref)
    return head_dim is not None and select.unsupported_reason(ref.device, dtype, head_dim, variant=(select.WINDOW,)) is None


# -- public API -----------------------------------------------------------------


def unpad(model, enabled: bool = True, *, buckets: bool = False):
    """Make `model` (a transformers model) run padded batches packed; returns `model`.

    In place and idempotent; ``unpad(model, enabled=False)`` undoes it. Takes the
    base model (``BertModel``, ``LlamaModel``, ...) or a head on one
    (``*ForMaskedLM``, ``*ForSequenceClassification``, ``*ForCausalLM``, ...,
    see :data:`FAMILIES`). The packed layout runs on our attention only, so where
    the model's ``attn_implementation`` is not a name from
    :func:`ragged_compile.hf.register`, it is set to ``register()``'s (and put back
    by ``enabled=False``). Other classes are left untouched, said once at
    WARNING: their calls stay padded. Call it before ``torch.compile``.

    ``buckets=True`` is for ``torch.compile(mode="reduce-overhead")`` over
    batches of other layouts: the packed row is padded to one of a few lengths
    (:func:`bucket`: at most 1/8 above the batch's real total, or 16 tokens)
    with filler segments of at most ``FILLER_SEGMENT`` tokens (and no longer than
    a sliding window) whose outputs are dropped, the offsets get as many segments
    for every total of a bucket, and under ``torch.compile`` attention runs a
    kernel CUDA graphs capture (fp16/bf16 on SM80+: ``flash_backward.in_graph``),
    so one recorded graph serves every layout of a bucket and batch size.
    Outputs are those of ``buckets=False``. Each call sets it: ``unpad(model)``
    again turns it off.
    """
    from transformers import PreTrainedModel

    model = getattr(model, "_orig_mod", model)  # an OptimizedModule: patch the module it runs
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"unpad takes a transformers PreTrainedModel, got {type(model).__name__}")
    state = model.__dict__.get("_ragged_unpad_state")
    if not enabled:
        if state is not None:
            state.uninstall()
            del model.__dict__["_ragged_unpad_state"]
        return model
    if state is None:
        state = _State(model)
        model.__dict__["_ragged_unpad_state"] = state
    state.buckets = bool(buckets)
    return model


def is_unpadded(model) -> bool:
    return "_ragged_unpad_state" in getattr(model, "_orig_mod", model).__dict__


# -- installation ---------------------------------------------------------------


def _family_of(model):
    config = getattr(model, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None or not type(model).__module__.startswith("transformers.models."):
        return None, None
    name = type(model).__name__
    if not name.startswith(family.prefix):
        return None, None
    suffix = name[len(family.prefix):]
    if suffix == "Model":
        return family, None  # the base model: its own pooler decides (see _State)
    head = family.heads.get(suffix)
    if head is None:
        return None, None
    if family.prefix == "ModernBert" and suffix == "ForSequenceClassification":
        head = _FIRST if config.classifier_pooling == "cls" else _Head()
    return family, head


def _ours(config) -> bool:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .hf import attention_forward

    impl = getattr(config, "_attn_implementation", None)
    try:
        return impl is not None and ALL_ATTENTION_FUNCTIONS[impl] is attention_forward
    except KeyError:
        return False


def _params(module) -> list[str]:
    sig = inspect.signature(module.forward)
    return [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


class _State:
    """What unpad installed on one model (its top module and, for a head, its base)."""

    def __init__(self, top):
        from .hf import register

        self.top = top
        self.base = top.base_model
        self.buckets = False
        self.family, self.head = _family_of(top)
        if self.family is not None and self.base is not top:
            base_family, _ = _family_of(self.base)
            if base_family is not self.family:
                self.family = None
        self.unknown = self.family is None
        if self.unknown:
            _warn("unknown model class", top, f" (unpad knows {', '.join(sorted(FAMILIES))}: base models and "
                  f"their heads)")
        self.set_impl = None
        self.patched = []
        if self.unknown:
            return  # left as it is: every call is the padded one
        if not _ours(top.config):
            self.set_impl = top.config._attn_implementation
            top.set_attn_implementation(register())
            log.info("ragged_compile.hf.unpad: %s attn_implementation %r -> %r", type(top).__name__,
                     self.set_impl, top.config._attn_implementation)
        for module, fn in ((self.base, _base_forward),) + (((top, _top_forward),) if top is not self.base else ()):
            prev = module.__dict__.get("forward")
            orig = module.forward
            params = _params(module)
            wrapper = functools.partial(fn, self, orig, params)
            wrapper.__signature__ = inspect.signature(orig)
            wrapper.__doc__ = orig.__doc__
            module.forward = wrapper
            self.patched.append((module, prev))

    def uninstall(self):
        for module, prev in self.patched:
            if prev is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = prev
        self.patched = []
        if self.set_impl is not None and _ours(self.top.config):
            self.top.set_attn_implementation(self.set_impl)

    def __deepcopy__(self, memo):
        # The copy's forwards are partials over the copied state (bound to the copied modules).
        new = copy.copy(self)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


# -- fallback log -------------------------------------------------------------------


def _warn(reason: str, module, detail: str = "") -> None:
    warn_once(f"hf.unpad: {reason}{detail}: {type(module).__name__} runs the padded call")


# -- the forwards ---------------------------------------------------------------------


def _bind(params, args, kwargs) -> dict:
    if len(args) > len(params):
        raise TypeError(f"forward takes {len(params)} positional arguments, {len(args)} given")
    call = dict(kwargs)
    for name, value in zip(params, args):
        if name in call:
            raise TypeError(f"forward got multiple values for argument {name!r}")
        call[name] = value
    return call


def _wants_tuple(module, return_dict) -> bool:
    if return_dict is None:
        return_dict = getattr(module.config, "return_dict", True)
    return return_dict is False


def _top_forward(state, orig, params, *args, **kwargs):
    """A head on a known base: hands the head's checks to the base call, then zeroes
    the head's per-token outputs at padded positions where the base ran packed."""
    call = _bind(params, args, kwargs)
    ctx = {"head": state.head, "labels": call.get("labels"), "packed": None}
    if state.head.per_token and state.family.causal:
        keep = call.get("logits_to_keep", 0)
        if isinstance(keep, torch.Tensor) and keep.dim() > 0:
            ctx["refuse"] = "head reads a padded position"  # logits_to_keep as indices
    wants_tuple = _wants_tuple(state.top, call.pop("return_dict", None))
    out = orig(**call, **{_CTX: ctx}, return_dict=True)
    valid = ctx["packed"]
    if valid is not None:
        out = _zero_fields(out, state.head.per_token, valid)
    return out.to_tuple() if wants_tuple else out


def _zero_fields(out, names, valid):
    b, s = valid.shape
    fixed = {}
    for k in names:
        x = out.get(k)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] != b or not 0 < x.shape[1] <= s:
            continue
        v = valid[:, s - x.shape[1]:]  # logits_to_keep=k keeps the last k positions
        fixed[k] = x.masked_fill(~v.reshape(v.shape + (1,) * (x.dim() - 2)), 0)
    if not fixed:
        return out
    return type(out)(**{**dict(out.items()), **fixed})


def _base_forward(state, orig, params, *args, **kwargs):
    call = _bind(params, args, kwargs)
    ctx = call.pop(_CTX, None)
    return_dict = call.pop("return_dict", None)
    plan = _plan(state, call, ctx)
    if plan is None or "flat" not in plan:  # padded as given, or nothing padded
        call = call if plan is None else plan["call"]
        return orig(**call) if return_dict is None else orig(**call, return_dict=return_dict)
    wants_tuple = _wants_tuple(state.base, return_dict)
    out = _scatter(state, orig(**plan["call"], return_dict=True), plan)
    if ctx is not None:
        ctx["packed"] = plan["valid"]
    return out.to_tuple() if wants_tuple else out


def _static_reason(state, call, ctx) -> str | None:
    """Reasons known without reading the mask (no device sync)."""
    base, config = state.base, state.base.config
    if ctx is not None and ctx.get("refuse"):
        return ctx["refuse"]
    if not _ours(config):
        return "attention implementation is not ours"
    if ((call.get("use_cache") and (state.family.causal or getattr(config, "is_decoder", False)))
            or call.get("cache") is not None or call.get("past_key_values") is not None):
        return "use_cache / past_key_values"
    if call.get("output_attentions") or getattr(config, "output_attentions", False):
        return "output_attentions"
    if ((getattr(config, "is_decoder", False) and not state.family.causal)
            or getattr(config, "add_cross_attention", False) or call.get("encoder_hidden_states") is not None):
        return "decoder / cross-attention config"
    mask = call.get("attention_mask")
    ref = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    if (base.training and any((getattr(config, k, 0) or 0) > 0 for k in state.family.dropout)
            and not _dropout_runs_on_op(base, config, ref)):
        # where no kernel of the op drops out, the packed call would hand the model's
        # own attention a dense [T, T] mask
        return "attention dropout in training"
    if (not isinstance(mask, torch.Tensor) or ref is None or mask.dim() != 2
            or tuple(mask.shape) != tuple(ref.shape[:2])):
        return "attention_mask is not a 2-D padding mask"
    b, s = mask.shape
    for k, v in call.items():
        if k in _PACKED_INPUTS or k == "attention_mask" or not isinstance(v, torch.Tensor):
            continue
        if v.dim() >= 2 and tuple(v.shape[:2]) == (b, s):
            return "per-token input unpad does not know"
    for k in ("token_type_ids", "position_ids"):
        v = call.get(k)
        if v is not None and (v.dim() != 2 or v.shape[-1] != s or v.shape[0] not in (1, b)):
            return "per-token input unpad does not know"
    return None


def _head_checks(state, call, ctx, valid):
    """Device bools the head needs true: (to read only valid positions, for its labels
    to score only valid logits)."""
    head = ctx["head"] if ctx is not None else (_FIRST if getattr(state.base, "pooler", None) is not None else _Head())
    b, s = valid.shape
    checks, label_checks = [], []
    if head.reads == "first":
        checks.append(valid[:, 0].all())
    elif head.reads == "last_non_pad":
        pad = state.base.config.get_text_config().pad_token_id
        ids = call.get("input_ids")
        if pad is None or ids is None:
            last = torch.full((b,), s - 1, device=valid.device)
        else:
            idx = torch.arange(s, device=ids.device, dtype=torch.int32)
            # a mask on the host: the b positions come to it (the one read this head costs)
            last = (idx * (ids != pad).to(torch.int32)).argmax(-1).to(valid.device)
        checks.append(valid[torch.arange(b, device=valid.device), last].all())
    labels = ctx.get("labels") if ctx is not None else None
    per_token = isinstance(labels, torch.Tensor) and labels.dim() == 2 and tuple(labels.shape) == (b, s)
    if head.labels is not None and per_token:
        labels = labels.to(valid.device)
        if head.labels == "shifted":
            label_checks.append(((labels[:, 1:] == IGNORE_INDEX) | valid[:, :-1]).all())
        else:
            label_checks.append(((labels == IGNORE_INDEX) | valid).all())
    return checks, label_checks


_READS = {"first": " (position 0)", "last_non_pad": " (the last token that is not pad_token_id)"}


def _window(config) -> int | None:
    w = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if w is None or (types is not None and not any("sliding" in t for t in types)):
        return None
    return int(w)


def _to_device(x, device):
    """``x`` (on the host) on ``device``; on CUDA without waiting for queued GPU work."""
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@torch.compiler.disable
def _plan(state, call, ctx):
    """The packed call (``call``, ``flat``, ``valid``); an encoder's call without its
    mask where no row is padded (``call`` alone); or None for the call as given.
    Runs eagerly (a graph break
    under torch.compile): the one host read of the mask's lengths is here."""
    if any(call.get(k) is not None for k in _PACKED_KWARGS) or call.get("attention_mask") is None:
        return None  # packed already, or no padding: runs as given
    mask = call["attention_mask"]
    ref = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    moved = None
    if isinstance(mask, torch.Tensor) and isinstance(ref, torch.Tensor) and mask.device != ref.device:
        # A mask the caller keeps on the host (ids on the GPU): it is read for free, and
        # a call that runs padded gets it where the model computes.
        if mask.device.type != "cpu":
            raise ValueError(f"ragged_compile.hf.unpad: attention_mask is on {mask.device}, the inputs on "
                             f"{ref.device}; pass it on the inputs' device or on the CPU")
        moved = {"call": {**call, "attention_mask": _to_device(mask, ref.device)}}
    reason = _static_reason(state, call, ctx)
    detail = ""
    if reason is None:
        b, s = mask.shape
        if b == 0 or s == 0:
            return moved
        from .hf import _host_runs

        valid = mask != 0
        checks, label_checks = _head_checks(state, call, ctx, valid)
        flags = [*checks, *label_checks]
        # The one host read: the mask (as bools) and the head's checks. Runs, totals and
        # the packed indices are host work on that copy (numpy: a few microseconds),
        # where a dozen small kernels each cost a launch. A mask on the host costs no
        # read (a head's checks on device tensors still do).
        host = (torch.cat([valid.flatten(), torch.stack(flags)]) if flags else valid).cpu().numpy()
        host_valid = host[:b * s].reshape(b, s)
        checks, label_checks = host[b * s:b * s + len(checks)], host[b * s + len(checks):]
        if moved is not None:
            valid = moved["call"]["attention_mask"] != 0
        runs = _host_runs(host_valid, s, False)  # each row's (start, count); None: not padding
        if runs is None:
            reason = "valid tokens are not one run per row"
        else:
            n = runs[1]
            total, longest = int(n.sum()), int(n.max())
            if total == b * s:
                # Nothing to pack. An encoder's all-ones mask says nothing either: the model
                # runs without it, so its attention reads no mask again (transformers
                # treats None as every key valid; hf.py runs dense SDPA on such rows, as
                # stock does). A decoder keeps it: without it, it would read position_ids.
                return moved if state.family.causal else {"call": {**call, "attention_mask": None}}
            if total == 0:
                return moved
            if not checks.all():
                reason = "head reads a padded position"
                detail = _READS[(ctx["head"] if ctx is not None else _FIRST).reads]
            elif not label_checks.all():
                reason = "labels at padded positions"
            else:
                w = _window(state.base.config)
                if w is not None and longest > w and not _window_runs_on_op(state.base, state.base.config, mask):
                    reason = "sliding window shorter than a sequence"
    if reason is not None:
        _warn(reason, state.top, detail)
        return moved
    return _pack(state, call, valid, host_valid, n, longest)


FILLER_SEGMENT = 128  # tokens of one filler segment (buckets=True): its attention costs at most this per token


def bucket(total: int) -> int:
    """The packed length ``unpad(..., buckets=True)`` runs a batch of ``total`` valid
    tokens at: ``total`` rounded up to a multiple of 2**(floor(log2(total)) - 3),
    at least 16; eight lengths an octave, each at most 1/8 above the total (or 15
    tokens, below 128)."""
    step = max(16, 1 << max(total.bit_length() - 4, 0))
    return -(-total // step) * step


def _fillers(total: int, most: int = FILLER_SEGMENT) -> np.ndarray:
    """The lengths of the filler segments (each at most ``most`` tokens) that take
    ``total`` to its bucket: as many for every total of a bucket (empty ones where
    fewer do), so the offsets' shape is the bucket's too."""
    b = bucket(total)
    extra = b - total
    lengths = [most] * (extra // most) + ([extra % most] if extra % most else [])
    # extra < the bucket's step <= b / 8 tokens (16 at least)
    slots = max(1, -(-max(b // 8, 16) // most))
    return np.array(lengths + [0] * (slots - len(lengths)), dtype=np.int64)


def _pack(state, call, valid, host_valid, n, longest):
    """The packed call from the mask's host copy: the valid positions' flat indices
    and columns, and the offsets, each computed on the host and copied over once."""
    b, s = valid.shape
    dev = valid.device
    flat = np.flatnonzero(host_valid)  # row-major: each row's run, rows in order
    total = len(flat)
    # No longer than the model's position table (fillers' position ids count from 0),
    # nor than its sliding window: a filler then never needs the window, so a call
    # whose sequences the window spans stays on kernels without one.
    config = state.base.config
    most = min(FILLER_SEGMENT, getattr(config, "max_position_embeddings", None) or FILLER_SEGMENT,
               _window(config) or FILLER_SEGMENT)
    fill = _fillers(total, most) if state.buckets else np.zeros(0, np.int64)
    # Filler tokens: segments of their own (so no real token sees them), position ids
    # counting from 0 in each (valid in every model's table); their outputs are dropped.
    fill_pos = np.concatenate([np.arange(k) for k in fill]) if fill.sum() else np.zeros(0, np.int64)
    cu = np.concatenate(([0], np.cumsum(np.concatenate((n, fill))))).astype(np.int32)
    with torch.inference_mode(False):
        # Offsets that keep a version (not inference tensors): the runtime may keep
        # their host copy and hf.py need not copy them per forward.
        host_cu = torch.from_numpy(cu)
        idx = torch.from_numpy(np.concatenate((flat, flat % s, fill_pos)))
        idx, cu32 = _to_device(idx, dev), _to_device(host_cu, dev)
    flat, col, fill_pos = idx[:total], idx[total:2 * total], idx[2 * total:]  # col: the column in the padded row
    n_fill = len(fill_pos)

    def packed(x, tail=()):  # [b, s, *tail] -> [1, total (+ fillers), *tail]
        x = x.reshape(b * s, *tail)[flat]
        if n_fill:
            x = torch.cat((x, x.new_zeros((n_fill, *tail))))
        return x[None]

    new = dict(call)
    new["attention_mask"] = None
    if state.family.mask_mapping:
        new["attention_mask"] = {t: None for t in set(state.base.config.layer_types)}
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    if ids is not None:
        new["input_ids"] = packed(ids)
    if embeds is not None:
        new["inputs_embeds"] = packed(embeds, embeds.shape[2:])
    tt = call.get("token_type_ids")
    if tt is not None:
        new["token_type_ids"] = packed(tt.expand(b, s))
    pos = call.get("position_ids")
    if pos is not None:
        pos = pos.expand(b, s).reshape(b * s)[flat]
    elif state.family.positions == "padding_idx":
        emb = state.base.embeddings
        pad = emb.padding_idx
        if ids is not None:
            pos = emb.create_position_ids_from_input_ids(ids, pad).reshape(b * s)[flat]
        else:
            pos = col + pad + 1
    else:
        pos = col
    new["position_ids"] = (torch.cat((pos, fill_pos.to(pos.dtype))) if n_fill else pos)[None]
    if state.family.causal:
        new["use_cache"] = False
    longest = max(longest, int(fill.max()) if len(fill) else 0)
    if state.buckets:
        from .hf import IN_GRAPH

        new[IN_GRAPH] = True
        dtype, head_dim = _attention_dtype_and_head_dim(state.base, config, valid)
        if dev.type == "cuda" and head_dim is not None and flash_backward.unsupported_reason(dev, dtype, head_dim) is None:
            # Compiled, attention runs flash_backward.in_graph, whose grid alone the longest
            # length sizes (query tiles of 128 rows): rounded up, it takes few values, as
            # the packed length does. (Only there: a window check reads it too.)
            longest = -(-longest // 128) * 128
    new.update(cu_seq_lens_q=cu32, cu_seq_lens_k=cu32, max_length_q=longest, max_length_k=longest)
    for k in ("input_ids", "inputs_embeds", "token_type_ids", "position_ids"):
        if new.get(k) is not None:
            torch._dynamo.maybe_mark_dynamic(new[k], 1)
    torch._dynamo.maybe_mark_dynamic(flat, 0)
    torch._dynamo.maybe_mark_dynamic(cu32, 0)
    if dev.type in _KNOWN_OFFSETS_DEVICES:
        # The runtime plans every layer from the host offsets and reads nothing back
        # (eager; compiled, where the graph hands the op the same tensor).
        from .runtime import get_runtime

        get_runtime(dev).know_offsets(cu32, host_cu)
    return {"call": new, "flat": flat, "valid": valid}


@torch.compiler.disable
def _scatter(state, out, plan):
    """The packed outputs in the caller's ``[B, S, ...]``. Eager (a graph break under
    torch.compile), so that what is compiled around the packed model never sees the
    caller's padded shape."""
    valid, flat = plan["valid"], plan["flat"]
    b, s = valid.shape

    def back(x):
        if x is None:
            return None
        full = x.new_zeros((b * s,) + x.shape[2:])
        return full.index_copy(0, flat, x[0, :flat.shape[0]]).view((b, s) + x.shape[2:])

    fields = {}
    for k, v in out.items():
        if k == "last_hidden_state":
            fields[k] = back(v)
        elif k == "hidden_states":
            fields[k] = tuple(back(h) for h in v)
        elif k == "pooler_output":
            pass  # recomputed on the padded output below
        elif k in ("cache", "past_key_values"):
            fields[k] = None
        else:
            raise RuntimeError(f"ragged_compile.hf.unpad: {type(state.base).__name__} returned {k!r}, which unpad "
                               f"does not know how to scatter; please report")
    if "pooler_output" in out:
        fields["pooler_output"] = state.base.pooler(fields["last_hidden_state"])
    return type(out)(**fields)
