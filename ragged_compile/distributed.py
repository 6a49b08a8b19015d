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
==================================  ==========================================

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


def _attention_rule(q, k, v, cu_q, cu_k, causal, scale):
    rules = [([_R], [_R, _R, _R, _R, _R, None, None])]
    if _heads_split_evenly(q, k):
        rules.append(([_H], [_H, _H, _H, _R, _R, None, None]))
    return rules


def _attention_lse_rule(q, k, v, cu_q, cu_k, causal, scale):
    rules = [([_R, _R, _R], [_R, _R, _R, _R, _R, None, None])]
    if _heads_split_evenly(q, k):
        rules.append(([_H, _LSE, _R], [_H, _H, _H, _R, _R, None, None]))
    return rules


def _lse_backward_rule(grad_out, q, k, v, out, lse, cu_q, cu_k, max_lens, causal, scale):
    rules = [([_R, _R, _R], [_R, _R, _R, _R, _R, _R, _R, _R, _R, None, None])]
    if _heads_split_evenly(q, k):
        rules.append(([_H, _H, _H], [_H, _H, _H, _H, _H, _LSE, _R, _R, _R, None, None]))
    return rules


def _reference_backward_rule(grad_out, q, k, v, cu_q, cu_k, causal, scale):
    rules = [([_R, _R, _R], [_R, _R, _R, _R, _R, _R, None, None])]
    if _heads_split_evenly(q, k):
        rules.append(([_H, _H, _H], [_H, _H, _H, _H, _R, _R, None, None]))
    return rules


@functools.cache
def register() -> None:
    """Register the rules with DTensor (idempotent; done on import)."""
    ns = torch.ops.ragged_compile
    register_sharding(ns.ragged_attention.default)(_attention_rule)
    register_sharding(ns.ragged_attention_lse.default)(_attention_lse_rule)
    register_sharding(ns.ragged_attention_lse_backward.default)(_lse_backward_rule)
    register_sharding(ns.ragged_attention_backward.default)(_reference_backward_rule)


register()
