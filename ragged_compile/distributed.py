"""DTensor sharding rules for the ops: head-parallel attention runs shard-local.

Tensor parallelism over heads (``parallelize_module`` with column-wise q/k/v
projections) hands the op q/k/v as DTensors sharded on the head dim,
``Shard(1)`` of ``[T, H, D]``, and the offsets replicated. Each head's attention
needs only its own head (and, with GQA, its k/v head), so every rank runs the
op on its local heads: no all-gather. Rules registered here (import this module,
or call :func:`register`; ``import ragged_compile`` does not pull in
torch.distributed):

==================================  ==========================================
op                                  head-sharded strategy
==================================  ==========================================
``ragged_attention``                q, k, v ``Shard(1)``; offsets ``Replicate``
                                    -> out ``Shard(1)``
``ragged_attention_lse``            same -> out ``Shard(1)``, lse ``[Hq, Tq]``
                                    ``Shard(0)``, max_lens ``Replicate``
``ragged_attention_lse_backward``   grad_out, q, k, v, out ``Shard(1)``, lse
                                    ``Shard(0)`` -> dq, dk, dv ``Shard(1)``
``ragged_attention_backward``       grad_out, q, k, v ``Shard(1)`` -> ``Shard(1)``
``ragged_attention_dropout`` and    replicated only: each rank would draw the same
its backward                        mask for its own heads (its generator, not
                                    DTensor's), correlating heads across ranks
==================================  ==========================================

The variant arguments follow the heads: ``sinks`` ``[Hq]`` is ``Shard(0)`` where the
heads are split (``Replicate`` otherwise), and so is the backward's ``dsinks``;
window and softcap are plain numbers. A call without sinks returns an empty
``dsinks``, replicated.

Everything replicated is always offered too. GQA stays correct shard-local only
when every rank holds whole groups: query head ``h`` uses k/v head ``h // G``,
so the head split is offered only when the k/v heads divide evenly over the
mesh (``Hkv % mesh.size() == 0``, hence ``Hq`` too); otherwise DTensor
replicates, correct but with an all-gather.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from . import ops as _ops  # noqa: F401  (registers the ops)

__all__ = ["register"]

_R, _H, _LSE = Replicate(), Shard(1), Shard(0)


def _heads_split_evenly(q, k) -> bool:
    n = k.mesh.size()
    return k.shape[1] % n == 0 and q.shape[1] % n == 0


_NUMBERS = [None, None, None, None, None, None]  # causal, scale, window_left, window_right, softcap (+ sinks)


def _variant_specs(sinks, split: bool):
    """Input specs of (causal, scale, window_left, window_right, softcap, sinks), and
    the dsinks output spec."""
    if sinks is None:
        return _NUMBERS, _R
    spec = _LSE if split else _R  # [Hq]: dim 0 is the heads
    return _NUMBERS[:5] + [spec], spec


def _attention_rule(q, k, v, cu_q, cu_k, causal, scale, window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    rules = [([_R], [_R, _R, _R, _R, _R] + _variant_specs(sinks, False)[0])]
    if _heads_split_evenly(q, k):
        rules.append(([_H], [_H, _H, _H, _R, _R] + _variant_specs(sinks, True)[0]))
    return rules


def _attention_lse_rule(q, k, v, cu_q, cu_k, causal, scale, window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    rules = [([_R, _R, _R], [_R, _R, _R, _R, _R] + _variant_specs(sinks, False)[0])]
    if _heads_split_evenly(q, k):
        rules.append(([_H, _LSE, _R], [_H, _H, _H, _R, _R] + _variant_specs(sinks, True)[0]))
    return rules


def _lse_backward_rule(grad_out, q, k, v, out, lse, cu_q, cu_k, max_lens, causal, scale, window_left=-1,
                       window_right=-1, softcap=0.0, sinks=None):
    specs, ds = _variant_specs(sinks, False)
    rules = [([_R, _R, _R, ds], [_R, _R, _R, _R, _R, _R, _R, _R, _R] + specs)]
    if _heads_split_evenly(q, k):
        specs, ds = _variant_specs(sinks, True)
        rules.append(([_H, _H, _H, ds], [_H, _H, _H, _H, _H, _LSE, _R, _R, _R] + specs))
    return rules


def _reference_backward_rule(grad_out, q, k, v, cu_q, cu_k, causal, scale, window_left=-1, window_right=-1,
                             softcap=0.0, sinks=None):
    specs, ds = _variant_specs(sinks, False)
    rules = [([_R, _R, _R, ds], [_R, _R, _R, _R, _R, _R] + specs)]
    if _heads_split_evenly(q, k):
        specs, ds = _variant_specs(sinks, True)
        rules.append(([_H, _H, _H, ds], [_H, _H, _H, _H, _R, _R] + specs))
    return rules


def _dropout_rule(q, k, v, cu_q, cu_k, causal, scale, dropout_p):
    return [([_R, _R, _R, _R], [_R, _R, _R, _R, _R, None, None, None])]


def _dropout_backward_rule(grad_out, q, k, v, out, lse, cu_q, cu_k, max_lens, rng_state, causal, scale, dropout_p):
    return [([_R, _R, _R], [_R] * 10 + [None, None, None])]


@functools.cache
def register() -> None:
    """Register the rules with DTensor (idempotent; done on import)."""
    ns = torch.ops.ragged_compile
    register_sharding(ns.ragged_attention.default)(_attention_rule)
    register_sharding(ns.ragged_attention_lse.default)(_attention_lse_rule)
    register_sharding(ns.ragged_attention_lse_backward.default)(_lse_backward_rule)
    register_sharding(ns.ragged_attention_backward.default)(_reference_backward_rule)
    register_sharding(ns.ragged_attention_dropout.default)(_dropout_rule)
    register_sharding(ns.ragged_attention_dropout_backward.default)(_dropout_backward_rule)


register()
