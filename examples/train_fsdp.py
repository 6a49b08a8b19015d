"""Train an NJT encoder on ragged batches across GPUs: FSDP2 or head-parallel TP.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --mode fsdp
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --mode tp
    ... --check          # compare loss and gradients with a one-GPU run of the global batch
    ... --bench          # tokens/s (run with --nproc-per-node 1 and 2 for the scaling row)

FSDP2 (``fully_shard``): every rank trains on its own ragged batch, an NJT
``[B, j, E]``. Each block is compiled with ``ragged_compile.compile`` (the
usual FSDP2 recipe: compiling the root instead graph-breaks at FSDP's hooks),
and one runtime step spans the whole forward, so each rank plans once per
forward however many blocks it has. Attention runs forward and backward on
ragged_compile's op (FlashInfer forward with LSE, FlashAttention-2 backward).

TP (``parallelize_module``): the packed ``[T, E]`` tokens of one global batch on
every rank; q/k/v projections column-parallel with DTensor outputs, so attention
sees q/k/v sharded on the head dim and the offsets replicated, and runs
shard-local through the sharding rules of ``ragged_compile.distributed``; out
and feed-forward projections row-parallel.

Writes a JSON summary with ``--json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ragged_compile as rc
from ragged_compile.runtime import get_runtime


class Block(nn.Module):
    """Pre-norm encoder block; the same code runs on NJTs (FSDP) and packed tensors (TP)."""

    def __init__(self, E: int, nheads: int, kv_heads: int, causal: bool):
        super().__init__()
        self.nheads, self.kv_heads, self.E_head, self.causal = nheads, kv_heads, E // nheads, causal
        self.norm1 = nn.LayerNorm(E)
        self.q_proj = nn.Linear(E, E, bias=False)
        self.k_proj = nn.Linear(E, kv_heads * self.E_head, bias=False)
        self.v_proj = nn.Linear(E, kv_heads * self.E_head, bias=False)
        self.out_proj = nn.Linear(E, E, bias=False)
        self.norm2 = nn.LayerNorm(E)
        self.ff_in = nn.Linear(E, 4 * E, bias=False)
        self.ff_out = nn.Linear(4 * E, E, bias=False)

    def forward(self, x, cu_seqlens=None):
        h = self.norm1(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if cu_seqlens is None:  # NJT [B, j, E]: SDPA, rewritten onto our op
            q = q.unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
            k = k.unflatten(-1, [self.kv_heads, self.E_head]).transpose(1, 2)
            v = v.unflatten(-1, [self.kv_heads, self.E_head]).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
            a = a.transpose(1, 2).flatten(-2)
        else:  # packed [T, E] (DTensors under TP): the op directly
            q = q.unflatten(-1, [-1, self.E_head])
            k = k.unflatten(-1, [-1, self.E_head])
            v = v.unflatten(-1, [-1, self.E_head])
            a = rc.ragged_attention(q, k, v, cu_seqlens, causal=self.causal).flatten(-2)
        x = x + self.out_proj(a)
        return x + self.ff_out(F.gelu(self.ff_in(self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self, layers: int, E: int, nheads: int, kv_heads: int, causal: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block(E, nheads, kv_heads, causal) for _ in range(layers))

    def forward(self, x, cu_seqlens=None):
        for block in self.blocks:
            x = block(x, cu_seqlens) if cu_seqlens is not None else block(x)
        return x


DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}


def lengths(rank: int, step: int, n: int, lo: int, hi: int) -> list[int]:
    rng = random.Random(1000 * step + rank)
    return [rng.randint(lo, hi) for _ in range(n)]


def make_batch(lens, E, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, E, generator=g) for n in lens]
    return torch.nested.nested_tensor(parts, layout=torch.jagged, device=device, dtype=dtype)


def build(args, device) -> Encoder:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Encoder(args.layers, args.dim, args.heads, args.kv_heads, causal=True).to(device, dtype)


def loss_of(out_values: torch.Tensor, target: torch.Tensor, denom: float) -> torch.Tensor:
    return (out_values.float() - target.float()).square().sum() / denom


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fsdp", "tp"], default="fsdp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--segments", type=int, default=8, help="segments per rank (FSDP) / per batch (TP)")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, reference kernel (a smoke test)")
    args = p.parse_args()
    if args.check and args.bench:
        p.error("--check and --bench are separate runs")

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(args.device, (world,))
    from torch._dynamo.utils import counters

    result = {"mode": args.mode, "world": world, "args": vars(args)}
    if args.mode == "fsdp":
        result.update(run_fsdp(args, mesh, rank, world, device))
    else:
        result.update(run_tp(args, mesh, rank, world, device))
    result["graph_breaks"] = sum(counters["graph_break"].values())
    if rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _train(model, opt, batches, forward):
    """Run the steps; returns per-step losses, plans and syncs per forward, ms per step."""
    device = next(model.parameters()).device
    rt = get_runtime(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, plans, syncs, times = [], [], [], []
    for batch in batches:
        sync()
        t0 = time.perf_counter()
        before = dict(rt.stats)
        with rt.step():  # one step spans the forward: one plan per layout, every block
            loss = forward(model, batch)
        plans.append(rt.stats["plans"] - before.get("plans", 0))
        syncs.append(rt.stats["syncs"] - before.get("syncs", 0))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    return losses, plans, syncs, times


def run_fsdp(args, mesh, rank, world, device) -> dict:
    from torch.distributed.fsdp import fully_shard

    steps = args.steps + (3 if args.bench else 0)
    per_rank = [[lengths(r, s, args.segments, args.min_len, args.max_len) for r in range(world)] for s in range(steps)]
    global_tokens = [sum(map(sum, step)) for step in per_rank]

    def batch_of(s, r):
        x = make_batch(per_rank[s][r], args.dim, device, DTYPE[device.type], seed=10 * s + r)
        t = make_batch(per_rank[s][r], args.dim, device, DTYPE[device.type], seed=10 * s + r + 5)
        return x, t, global_tokens[s]

    model = build(args, device)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh)
        model.blocks[i] = rc.compile(block, fullgraph=True)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward(m, b):
        x, t, denom = b
        # FSDP averages gradients over ranks: scale so they sum over the global batch.
        return loss_of(m(x).values(), t.values(), denom) * world

    losses, plans, syncs, times = _train(model, opt, [batch_of(s, rank) for s in range(steps)], forward)
    losses = [l.clone() for l in losses]
    for l in losses:
        dist.all_reduce(l)
    out = {
        "losses": [float(l) / world for l in losses],
        "plans_per_forward": max(plans),
        "syncs_per_forward": max(syncs),
        "tokens_per_gpu_step": [sum(step[rank]) for step in per_rank],
    }
    if args.bench:
        warm = 3
        ms = sorted(times[warm:])[len(times[warm:]) // 2] * 1e3
        tok = sum(sum(step[r]) for step in per_rank[warm:] for r in range(world)) / len(per_rank[warm:])
        out["bench"] = {"median_step_ms": ms, "tokens_per_s": tok / (ms / 1e3), "gpus": world}
    if args.check:
        out["check"] = _check_fsdp(args, rank, world, device, per_rank, batch_of, global_tokens, model, out["losses"])
    return out


def _check_fsdp(args, rank, world, device, per_rank, batch_of, global_tokens, sharded, losses) -> dict:
    """One GPU, the same initial weights, the global batch of every step, plain autograd."""
    from torch.distributed.tensor import DTensor

    # Losses of every step (each depends on all earlier updates) and the final weights.
    finals = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
              for n, p in sharded.named_parameters()}
    res = {"passed": True}
    if rank == 0:
        ref = build(args, device)
        for i, block in enumerate(ref.blocks):
            ref.blocks[i] = rc.compile(block, fullgraph=True)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
        ref_losses = []
        for s in range(args.steps):
            xs, ts = zip(*(batch_of(s, r)[:2] for r in range(world)))
            lens = [n for r in range(world) for n in per_rank[s][r]]
            x = torch.nested.nested_tensor([t for x_ in xs for t in x_.unbind()], layout=torch.jagged)
            t = torch.nested.nested_tensor([t for t_ in ts for t in t_.unbind()], layout=torch.jagged)
            assert [int(n) for n in x.offsets().diff()] == lens
            loss = loss_of(ref(x).values(), t.values(), global_tokens[s])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_losses.append(float(loss.detach()))
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses[: args.steps], ref_losses))
        param_err = max(rel(finals[n], p.detach().cpu()) for n, p in ref.named_parameters())
        res = {"passed": loss_err < 2e-2 and param_err < 5e-2, "loss_rel_err": loss_err,
               "param_rel_err": param_err, "ref_losses": ref_losses}
    flag = torch.tensor([1.0 if res["passed"] else 0.0], device=device)
    dist.broadcast(flag, 0)
    res["passed"] = bool(flag.item())
    return res


FOREACH = os.environ.get("RC_EXAMPLE_FOREACH") == "1" or None  # None: torch's default (foreach on CUDA)


def run_tp(args, mesh, rank, world, device) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import ragged_compile.distributed  # noqa: F401  (sharding rules for the ops)

    steps = args.steps
    batches_lens = [lengths(0, s, args.segments, args.min_len, args.max_len) for s in range(steps)]
    model = build(args, device)
    ref = build(args, device) if args.check else None
    plan = {}
    for i in range(args.layers):
        for name in ("q_proj", "k_proj", "v_proj"):  # heads sharded, outputs stay DTensors
            plan[f"blocks.{i}.{name}"] = ColwiseParallel(use_local_output=False)
        plan[f"blocks.{i}.out_proj"] = RowwiseParallel(input_layouts=Shard(-1))
        plan[f"blocks.{i}.ff_in"] = ColwiseParallel()
        plan[f"blocks.{i}.ff_out"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    # Sharded (DTensor) and unsharded (norm) parameters in separate groups:
    # CUDA's default foreach AdamW cannot mix the two in one group.
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    opt = torch.optim.AdamW([{"params": sharded}, {"params": plain}], lr=1e-4, foreach=FOREACH)

    def batch_of(s):
        lens = batches_lens[s]
        g = torch.Generator().manual_seed(s)
        x = torch.randn(sum(lens), args.dim, generator=g).to(device, DTYPE[device.type])
        t = torch.randn(sum(lens), args.dim, generator=g).to(device, DTYPE[device.type])
        cu = torch.tensor([0] + lens).cumsum(0).to(device, torch.int32)
        return x, t, cu, sum(lens)

    def forward(m, b):
        x, t, cu, denom = b
        cu_d = DTensor.from_local(cu, mesh, [Replicate()], run_check=False)
        out = m(x, cu_d)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        return loss_of(out, t, denom)

    batches = [batch_of(s) for s in range(steps)]
    from torch.distributed.tensor.debug import CommDebugMode

    # collectives inside attention: run one forward/backward under CommDebugMode
    with CommDebugMode() as comms:
        with get_runtime(device).step():
            forward(model, batches[0]).backward()
    opt.zero_grad(set_to_none=True)
    per_module = comms.get_comm_counts()
    losses, plans, syncs, times = _train(model, opt, batches, forward)
    out = {"losses": [float(l) for l in losses], "plans_per_forward": max(plans),
           "syncs_per_forward": max(syncs), "comm_counts": {str(k): v for k, v in per_module.items()}}
    if args.check:
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
        ref_losses = []
        for b in batches:
            x, t, cu, denom = b
            loss = loss_of(ref(x, cu), t, denom)
            loss.backward()
            ropt.step()
            ropt.zero_grad(set_to_none=True)
            ref_losses.append(float(loss.detach()))
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref_losses))
        params = dict(ref.named_parameters())
        param_err = max(rel(p.full_tensor() if isinstance(p, DTensor) else p, params[n]) for n, p in model.named_parameters())
        # Per layer, TP needs exactly the projections' collectives: an all-reduce after
        # each row-parallel layer (forward) and after each column-parallel input grad
        # (backward); an all-gather in attention would add to these.
        gathers = [k for k in out["comm_counts"] if "gather" in k or "all_to_all" in k]
        out["check"] = {"passed": loss_err < 2e-2 and param_err < 5e-2 and not gathers,
                        "loss_rel_err": loss_err, "param_rel_err": param_err,
                        "gathers": gathers, "ref_losses": ref_losses}
    return out


if __name__ == "__main__":
    main()
