"""Inductor FX passes: varlen attention nodes -> ``ragged_compile::ragged_attention``.

Post-grad graphs hold varlen attention as ``aten._flash_attention_forward`` /
``aten._efficient_attention_forward`` with ``cu_seqlens`` (stock NJT SDPA on CUDA
when :func:`ragged_compile.enable` is not active, hand-written calls) or as the
opaque ``torch_attn._varlen_attn`` node of ``torch.nn.attention.varlen.varlen_attn``.
Each pass below rewrites one of these node kinds when, and only when, our op
computes exactly the same thing; every replacement and every skip is logged
under the ``ragged_compile`` logger with its reason.

Inductor skips custom passes on an FX-graph cache hit and keys the cache on
``uuid()``, so each pass hashes the sources of the modules whose code decides
what it rewrites: this one (every pass and helper) and ``backends/select.py``.
No list of helpers is kept by hand.

Inductor's pass slot is process-wide config, while ``ragged_compile.compile``
must never rewrite a plain ``torch.compile`` running on another thread. So
:func:`installed` puts one gated :class:`RaggedAttentionPasses` in the slot
while any of our compiles runs (reference-counted), and the gate is a context
variable that only our backend sets: everywhere else the slot does exactly what
the pass it wraps (the user's, or none) would do, and keys the cache the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import inspect
import logging
import operator
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch._inductor import config as _inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from .backends import select
from .backends.select import unsupported_reason
from . import ops as _ops  # noqa: F401  (registers the ops this module rewrites into)

__all__ = [
    "FlashVarlenPass",
    "EfficientVarlenPass",
    "VarlenAttnPass",
    "RaggedAttentionPasses",
    "ragged_attention_passes",
    "in_our_compile",
    "installed",
]

log = logging.getLogger("ragged_compile")

aten = torch.ops.aten
_RAGGED = torch.ops.ragged_compile.ragged_attention.default
_RAGGED_LSE = torch.ops.ragged_compile.ragged_attention_lse.default
_CASTS = {torch.ops.prims.convert_element_type.default, aten._to_copy.default}


@functools.cache
def _hash_source(*objs: Any) -> str:
    """A hash of the source of modules or classes (their release where no source ships)."""
    h = hashlib.sha256()
    for obj in objs:
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):  # installed without sources: key on the release
            from . import __version__

            name = getattr(obj, "__qualname__", None) or obj.__name__
            h.update(f"{getattr(obj, '__module__', '')}.{name}@{__version__}".encode())
    return h.hexdigest()


def _bind(node: torch.fx.Node) -> dict[str, Any]:
    """Arguments of an OpOverload node by schema name, defaults filled in.

    Positions differ between torch versions (``_varlen_attn`` gained arguments in
    2.13), so the passes never read arguments by position.
    """
    schema = node.target._schema
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _only_output_used(node: torch.fx.Node) -> str | None:
    """Reason to skip unless every user takes output 0 (log-sum-exp, rng state unused)."""
    for user in node.users:
        if user.target is not operator.getitem:
            return f"its result tuple is used whole by {user.format_node()}"
        if user.args[1] != 0 and user.users:
            return f"output {user.args[1]} (log-sum-exp / rng state / sizes) is used by {user.name}"
    return None


def _training_outputs(node: torch.fx.Node, stock_backward_reads: tuple[int, ...]) -> str | None:
    """Skip reason unless every used output is output 0 or one the stock backward
    reads (log-sum-exp, rng state, ...), for which our training forward stands in:
    the same out and LSE (aten layout), zeros for the rng state (no dropout).

    A training graph saves the rng state with the LSE; an LSE read without it is
    the user's own (``return_aux``), left to stock: bitwise it is the kernel's.
    """
    used = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
    if 1 in used and 2 not in used:
        return "output 1 (log-sum-exp) is read by user code, not only by the stock backward"
    for user in node.users:
        if user.target is not operator.getitem:
            return f"its result tuple is used whole by {user.format_node()}"
        i = user.args[1]
        if i == 0 or not user.users:
            continue
        if i not in stock_backward_reads:
            return f"output {i} is used by {user.name}"
        val = _val(user)
        if i > 1 and not (isinstance(val, torch.Tensor) and all(isinstance(n, int) for n in val.shape)):
            return f"output {i} has no static shape to stand in for"
    return None


def _lse_used(node: torch.fx.Node) -> bool:
    return any(u.args[1] != 0 and u.users for u in node.users)


def _peel_cast(cu: torch.fx.Node) -> torch.fx.Node:
    # NJT SDPA casts int64 offsets to int32 for flash; our op takes either, and a
    # runtime keying plans on the offsets tensor wants the original tensor.
    while (
        isinstance(cu, torch.fx.Node)
        and cu.target in _CASTS
        and set(cu.kwargs) <= {"dtype"}
        and isinstance(_val(cu.args[0]), torch.Tensor)
        and _val(cu.args[0]).dtype in (torch.int32, torch.int64)
    ):
        cu = cu.args[0]
    return cu


def _check_qkv(q: Any, k: Any, v: Any, dims: int = 3) -> str | None:
    """Skip reason unless q/k/v are packed ``[T, H, D]`` (``[1, T, H, D]`` for dims=4)."""
    q, k, v = _val(q), _val(k), _val(v)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q/k/v carry no tensor metadata"
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        return f"q/k/v are {q.dim()}-D, not packed {dims}-D"
    if dims == 4 and not (q.shape[0] == k.shape[0] == v.shape[0] == 1):
        return "leading dim is not 1 (not the varlen form)"
    if not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} differ"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return "q, k, v head dims differ"
    reason = unsupported_reason(q.device, q.dtype, q.shape[-1])
    if reason is not None:
        return reason
    hq, hkv = q.shape[-2], k.shape[-2]
    if not isinstance(hq, int) or not isinstance(hkv, int) or hkv == 0 or hq % hkv:
        return f"heads {hq}/{hkv} are not a static multiple"
    return None


def _scale(scale: Any, q: Any) -> float | str:
    """The softmax scale as a float, or a reason why it cannot be one."""
    if scale is None:
        d = _val(q).shape[-1]
        if not isinstance(d, int):
            return "head dim is symbolic and no scale is given"
        return d**-0.5
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    return f"scale {scale} is not a constant"


def _insert(graph: torch.fx.Graph, before: torch.fx.Node, target, args) -> torch.fx.Node:
    """Insert ``target(*args)`` with ``meta['val']`` computed on fake tensors."""
    with graph.inserting_before(before):
        new = graph.call_function(target, tuple(args))
    fake = torch._guards.detect_fake_mode([_val(a) for a in args if isinstance(a, torch.fx.Node)])
    if fake is not None:
        with fake:
            new.meta["val"] = target(*[_val(a) for a in args])
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in before.meta:
            new.meta[key] = before.meta[key]
    return new


def _squeeze0(graph: torch.fx.Graph, before: torch.fx.Node, t: torch.fx.Node) -> torch.fx.Node:
    # The efficient varlen form is [1, T, H, D], usually an unsqueeze of the packed tensor.
    if t.target is aten.unsqueeze.default and t.args[1] == 0:
        return t.args[0]
    return _insert(graph, before, aten.select.int, (t, 0, 0))


def _replace_output(graph: torch.fx.Graph, node: torch.fx.Node, out: torch.fx.Node) -> None:
    for user in list(node.users):  # getitem 0, or dead getitems of the other outputs
        if user.args[1] == 0:
            user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)


@torch.library.custom_op("ragged_compile::zero_state", mutates_args=())
def _zero_state(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros standing in for a stock forward's rng state (no dropout: the stock
    backward reads none of it). An op of our own, not ``aten.zeros``: Inductor's
    post-grad lowering has no uint64 ``zeros`` (it fails with "both a fallback
    and a decomp"); a custom op is an extern kernel."""
    return torch.zeros(shape, dtype=dtype, device=device)


@_zero_state.register_fake
def _(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


_ZERO_STATE = torch.ops.ragged_compile.zero_state.default


class _AttentionPass(CustomGraphPass):
    """One node kind -> our op. Subclasses give ``target()`` and ``plan()``."""

    name = "attention"

    def target(self):
        raise NotImplementedError

    def plan(self, node: torch.fx.Node, a: dict[str, Any]) -> tuple | str:
        """``(q, k, v, cu_q, cu_k, causal, scale)`` with 3-D q/k/v, or a skip reason."""
        raise NotImplementedError

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, plan: tuple) -> torch.fx.Node:
        if not _lse_used(node):
            return _insert(graph, node, _RAGGED, plan)
        # A training graph: the stock backward reads the forward's LSE (and rng
        # state). Our training forward gives the same out and LSE; the backward
        # stays the stock FlashAttention-2 one.
        res = _insert(graph, node, _RAGGED_LSE, plan)
        out = _insert(graph, node, operator.getitem, (res, 0))
        lse = _insert(graph, node, operator.getitem, (res, 1))
        for user in list(node.users):
            if user.args[1] == 1:
                user.replace_all_uses_with(lse)
            elif user.args[1] > 1 and user.users:
                v = _val(user)
                with graph.inserting_before(node):
                    zeros = graph.call_function(
                        _ZERO_STATE, (list(v.shape), v.dtype, v.device)
                    )
                with v.fake_mode:
                    zeros.meta["val"] = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
                user.replace_all_uses_with(zeros)
        return out

    def __call__(self, graph: torch.fx.Graph) -> None:
        target = self.target()
        if target is None:
            return
        for node in list(graph.find_nodes(op="call_function", target=target)):
            plan = self.plan(node, _bind(node))
            if isinstance(plan, str):
                log.info("ragged_compile: kept %s (%s): %s", node.name, self.name, plan)
                continue
            q, k, v, cu_q, cu_k, causal, scale = plan
            hq, hkv = _val(q).shape[-2], _val(k).shape[-2]
            _replace_output(graph, node, self.rewrite(graph, node, plan))
            log.info(
                "ragged_compile: replaced %s (%s) with ragged_compile.ragged_attention "
                "(causal=%s, heads %s/%s, cu_q=%s, cu_k=%s)",
                node.name, self.name, causal, hq, hkv, cu_q.name, cu_k.name,
            )

    def uuid(self) -> str:
        # This module (every pass and helper) and the support rules it asks.
        return f"{type(self).__name__}:{_hash_source(sys.modules[__name__], select)}"


class FlashVarlenPass(_AttentionPass):
    """``aten._flash_attention_forward`` with cu_seqlens. Flash causal is bottom-right, as ours."""

    name = "aten._flash_attention_forward"

    def target(self):
        return aten._flash_attention_forward.default

    def plan(self, node, a):
        if a["cum_seq_q"] is None or a["cum_seq_k"] is None:
            return "dense (no cu_seqlens)"
        if a["dropout_p"] != 0.0:
            return f"dropout_p={a['dropout_p']}"
        if a["return_debug_mask"]:
            return "debug mask requested"
        for extra in ("alibi_slopes", "seqused_k", "block_table"):
            if a.get(extra) is not None:
                return f"{extra} is given"
        left, right = a.get("window_size_left"), a.get("window_size_right")
        causal = bool(a["is_causal"])
        if left not in (None, -1) or right not in (None, -1, 0):
            return f"sliding window ({left}, {right})"
        causal = causal or right == 0
        reason = _training_outputs(node, (1, 2, 3)) or _check_qkv(a["query"], a["key"], a["value"])
        if reason:
            return reason
        scale = _scale(a["scale"], a["query"])
        if isinstance(scale, str):
            return scale
        cu_q, cu_k = _peel_cast(a["cum_seq_q"]), _peel_cast(a["cum_seq_k"])
        return (a["query"], a["key"], a["value"], cu_q, cu_k, causal, scale)


class EfficientVarlenPass(_AttentionPass):
    """``aten._efficient_attention_forward`` with cu_seqlens ([1, T, H, D] inputs).

    custom_mask_type 0 = none, 1 = causal from the top-left (differs from ours when
    a segment has Lq != Lk, which the graph cannot tell us), 2 = bottom-right.
    """

    name = "aten._efficient_attention_forward"

    def target(self):
        return aten._efficient_attention_forward.default

    def plan(self, node, a):
        if a["cu_seqlens_q"] is None or a["cu_seqlens_k"] is None:
            return "dense (no cu_seqlens)"
        if a["bias"] is not None:
            return "attention bias is given"
        if a["dropout_p"] != 0.0:
            return f"dropout_p={a['dropout_p']}"
        if a.get("seqlen_k") is not None:
            return "seqlen_k is given"
        if a.get("window_size") is not None:
            return f"sliding window {a['window_size']}"
        mask = a["custom_mask_type"]
        if mask not in (0, 2):
            return f"custom_mask_type={mask} (1 is top-left causal, ours is bottom-right)"
        reason = _only_output_used(node) or _check_qkv(a["query"], a["key"], a["value"], dims=4)
        if reason:
            return reason
        scale = _scale(a["scale"], a["query"])
        if isinstance(scale, str):
            return scale
        cu_q, cu_k = _peel_cast(a["cu_seqlens_q"]), _peel_cast(a["cu_seqlens_k"])
        return (a["query"], a["key"], a["value"], cu_q, cu_k, mask == 2, scale)

    def rewrite(self, graph, node, plan):
        q, k, v, cu_q, cu_k, causal, scale = plan
        q, k, v = (_squeeze0(graph, node, t) for t in (q, k, v))
        out = _insert(graph, node, _RAGGED, (q, k, v, cu_q, cu_k, causal, scale))
        return _insert(graph, node, aten.unsqueeze.default, (out, 0))


class VarlenAttnPass(_AttentionPass):
    """``torch_attn._varlen_attn`` (``torch.nn.attention.varlen.varlen_attn``).

    Read by argument name, since the schema changes between releases: on torch
    2.11 there is no ``enable_gqa`` and causal arrives as ``window_size=(-1, 0)``
    (plus ``is_causal``); other releases add KV-cache arguments, and 2.13 has
    ``enable_gqa``, ``seqused_k``, ``block_table`` and ``num_splits``. Unknown
    names are absent, hence ``.get``. Flash causal is bottom-right, as ours.
    """

    name = "torch_attn._varlen_attn"

    def target(self):
        ns = getattr(torch.ops, "torch_attn", None)
        packet = getattr(ns, "_varlen_attn", None) if ns is not None else None
        return getattr(packet, "default", None)

    def plan(self, node, a):
        if a.get("cu_seq_q") is None or a.get("cu_seq_k") is None:
            return "cu_seq_q or cu_seq_k is None"
        # Paged / partial / cached KV, under the names different torch versions use.
        for extra in ("seqused_k", "block_table", "k_cache", "v_cache", "cache_seqlens",
                      "cache_batch_idx", "page_table"):
            if a.get(extra) is not None:
                return f"{extra} is given (paged / partial / cached KV)"
        window = a.get("window_size")
        window = [-1, -1] if window is None else list(window)
        if window not in ([-1, -1], [-1, 0]):
            return f"sliding window {tuple(window)}"
        causal = bool(a.get("is_causal", False)) or window == [-1, 0]
        reason = _training_outputs(node, (1, 2)) or _check_qkv(a["query"], a["key"], a["value"])
        if reason:
            return reason
        hq, hkv = _val(a["query"]).shape[1], _val(a["key"]).shape[1]
        if hq != hkv and not a.get("enable_gqa", False):
            return f"q heads {hq} != kv heads {hkv} without enable_gqa"
        scale = _scale(a.get("scale"), a["query"])
        if isinstance(scale, str):
            return scale
        cu_q, cu_k = _peel_cast(a["cu_seq_q"]), _peel_cast(a["cu_seq_k"])
        return (a["query"], a["key"], a["value"], cu_q, cu_k, causal, scale)


class RaggedAttentionPasses(CustomGraphPass):
    """All of the above, after ``user_pass`` (whatever held the config slot before us).

    With ``gated=True`` our passes run only inside :func:`in_our_compile`
    (``ragged_compile.compile``'s backend); outside it the object is the user's
    pass in all but name, cache key included.
    """

    def __init__(self, user_pass: Any = None, extra_uuid: Any = None, gated: bool = False) -> None:
        self.user_pass = user_pass
        self.extra_uuid = extra_uuid
        self.gated = gated
        self.passes = (FlashVarlenPass(), EfficientVarlenPass(), VarlenAttnPass())

    def _users(self) -> tuple:
        if self.user_pass is None:
            return ()
        return tuple(self.user_pass) if isinstance(self.user_pass, (list, tuple)) else (self.user_pass,)

    def _on(self) -> bool:
        return not self.gated or _IN_OUR_COMPILE.get()

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self._users():
            p(graph)
        if self._on():
            for p in self.passes:
                p(graph)

    def uuid(self) -> Any:
        user = None
        if self._users():
            uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self._users()]
            if any(u is None for u in uuids):
                return None  # an uncacheable pass of the user's keeps the graph uncached
            user = tuple(uuids)
        if not self._on():
            # Not our compile: key as the user's pass would (a constant when there is
            # none: Inductor reads a pass without uuid as uncacheable).
            return ("ragged_compile: off", user)
        own = tuple(p.uuid() for p in self.passes)
        return (own, self.extra_uuid, user)


def ragged_attention_passes(user_pass: Any = None, extra_uuid: Any = None) -> RaggedAttentionPasses:
    """The pass for ``torch._inductor.config.post_grad_custom_post_pass``.

    ``user_pass`` (a pass or a list of passes that held the slot) runs first;
    ``extra_uuid`` joins the cache key, for code that shapes the graph before
    these passes see it (the NJT SDPA handler). Put there by hand, it rewrites
    every graph Inductor compiles; ``ragged_compile.compile`` does not need it.
    """
    return RaggedAttentionPasses(user_pass, extra_uuid)


_IN_OUR_COMPILE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ragged_compile_in_our_compile", default=False
)
_slot_lock = threading.Lock()
_slot_users = 0
_slot_ours: RaggedAttentionPasses | None = None
_slot_before: Any = None


@contextlib.contextmanager
def in_our_compile() -> Iterator[None]:
    """Open the gate of the installed passes for compiles run in this context."""
    token = _IN_OUR_COMPILE.set(True)
    try:
        yield
    finally:
        _IN_OUR_COMPILE.reset(token)


@contextlib.contextmanager
def installed(extra_uuid: Any = None) -> Iterator[None]:
    """Keep a gated :class:`RaggedAttentionPasses` in Inductor's slot while inside.

    Reference-counted across threads: the first to enter wraps whatever the slot
    holds, the last to leave puts it back (unless someone replaced ours meanwhile,
    in which case their value stays).
    """
    global _slot_users, _slot_ours, _slot_before
    with _slot_lock:
        if _slot_users == 0:
            current = _inductor_config.post_grad_custom_post_pass
            if isinstance(current, RaggedAttentionPasses) and current.gated:
                current = current.user_pass  # left behind by a process that died mid-call
            _slot_before = current
            _slot_ours = RaggedAttentionPasses(current, extra_uuid, gated=True)
            _inductor_config.post_grad_custom_post_pass = _slot_ours
        _slot_users += 1
    try:
        yield
    finally:
        with _slot_lock:
            _slot_users -= 1
            if _slot_users == 0:
                if _inductor_config.post_grad_custom_post_pass is _slot_ours:
                    _inductor_config.post_grad_custom_post_pass = _slot_before
                _slot_ours = _slot_before = None
