"""What the transformers tests share: our op's calls counted below autograd, padding masks."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ragged_compile  # noqa: F401  (registers the ops)

OURS = (torch.ops.ragged_compile.ragged_attention.default, torch.ops.ragged_compile.ragged_attention_lse.default)


class Count(TorchDispatchMode):
    """Counts calls of ``ops`` below autograd (a mode is off inside the ops it sees);
    by default our op's: the inference op, or (with grad) the training op that also
    saves the LSE."""

    def __init__(self, ops=OURS):
        super().__init__()
        self.ops, self.n = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.n += 1
        return func(*args, **(kwargs or {}))


def pad_mask(lengths, s, left=False):
    """[B, S] long 2-D padding mask: ``lengths[i]`` ones, right (or left) aligned."""
    m = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            m[i, s - n:] = 1
        else:
            m[i, :n] = 1
    return m
