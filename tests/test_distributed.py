"""Distributed: DTensor sharding rules (distributed.py) and two-GPU training.

CPU: the head-sharded rules on a fake process group (one process plays rank 0
of 2): the op runs on rank 0's local heads with no collective, forward and
backward, and gives that rank's slice of the unsharded result.
GPU: `examples/train_fsdp.py` under `torchrun --nproc-per-node 2` (FSDP2 and
head-parallel TP against a one-GPU run of the same global batch); skipped
without two GPUs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ragged_compile as rc

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _layout(hq, hkv, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lq, lk = [5, 0, 3, 7], [4, 2, 0, 7]
    q = torch.randn(sum(lq), hq, d, generator=g)
    k = torch.randn(sum(lk), hkv, d, generator=g)
    v = torch.randn(sum(lk), hkv, d, generator=g)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    return q, k, v, cq, ck


def _local_heads(x, rank=0, world=2):
    h = x.shape[1] // world
    return x[:, rank * h : (rank + 1) * h]


@pytest.mark.parametrize("op", ["ragged_attention", "ragged_attention_lse"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_head_sharded_attention_runs_shard_local(fake_mesh, op, hq, hkv):
    import ragged_compile.distributed  # noqa: F401
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    q, k, v, cq, ck = _layout(hq, hkv)
    causal = True
    # rank 0's shards, built without communication
    leaves = [_local_heads(t).clone().requires_grad_() for t in (q, k, v)]
    dq_, dk_, dv_ = (DTensor.from_local(t, fake_mesh, [Shard(1)], run_check=False) for t in leaves)
    cu_q, cu_k = (DTensor.from_local(c, fake_mesh, [Replicate()], run_check=False) for c in (cq, ck))
    grad = torch.randn(q.shape[0], hq // 2, q.shape[2])
    fn = getattr(torch.ops.ragged_compile, op)
    with CommDebugMode() as comms:
        res = fn(dq_, dk_, dv_, cu_q, cu_k, causal, 0.25)
        out = res[0] if isinstance(res, tuple) else res
        assert out.placements == (Shard(1),)
        if isinstance(res, tuple):
            assert res[1].placements == (Shard(0),) and res[2].placements == (Replicate(),)
        out.to_local().backward(grad)
    assert comms.get_total_counts() == 0, comms.get_comm_counts()

    # the unsharded reference, restricted to rank 0's heads
    ql, kl, vl = (_local_heads(t).clone().requires_grad_() for t in (q, k, v))
    want = rc.reference_attention(ql, kl, vl, cq, ck, causal, 0.25)
    want.backward(grad)
    torch.testing.assert_close(out.to_local(), want)
    for t, ref in zip(leaves, (ql, kl, vl)):
        torch.testing.assert_close(t.grad, ref.grad)


@pytest.mark.parametrize("op", ["ragged_attention", "ragged_attention_lse"])
def test_sinks_shard_with_heads(fake_mesh, op):
    """A window and sinks: the sinks split with the query heads, d(sinks) too."""
    import ragged_compile.distributed  # noqa: F401
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    q, k, v, cq, ck = _layout(4, 2)
    sinks = 2 * torch.randn(4, generator=torch.Generator().manual_seed(1))
    local = [_local_heads(t).clone().requires_grad_() for t in (q, k, v)]
    s_local = sinks[:2].clone().requires_grad_()  # rank 0's heads
    dt = [DTensor.from_local(t, fake_mesh, [Shard(1)], run_check=False) for t in local]
    ds = DTensor.from_local(s_local, fake_mesh, [Shard(0)], run_check=False)
    cu_q, cu_k = (DTensor.from_local(c, fake_mesh, [Replicate()], run_check=False) for c in (cq, ck))
    grad = torch.randn(q.shape[0], 2, q.shape[2])
    with CommDebugMode() as comms:
        res = getattr(torch.ops.ragged_compile, op)(*dt, cu_q, cu_k, True, 0.25, 2, -1, 0.0, ds)
        out = res[0] if isinstance(res, tuple) else res
        assert out.placements == (Shard(1),)
        out.to_local().backward(grad)
    assert comms.get_total_counts() == 0, comms.get_comm_counts()
    ql, kl, vl, sl = (t.detach().clone().requires_grad_() for t in (local[0], local[1], local[2], s_local))
    want = rc.reference_attention(ql, kl, vl, cq, ck, True, 0.25, window_size=(2, -1), sinks=sl)
    want.backward(grad)
    torch.testing.assert_close(out.to_local(), want)
    for t, ref in zip(local + [s_local], (ql, kl, vl, sl)):
        torch.testing.assert_close(t.grad, ref.grad)


def test_uneven_kv_heads_are_not_split(fake_mesh):
    """One k/v head over two ranks: splitting the query heads would pair rank 1's
    queries with the wrong k/v head, so the rule replicates instead."""
    import ragged_compile.distributed  # noqa: F401
    from torch.distributed.tensor import DTensor, Replicate, Shard

    q, k, v, cq, ck = _layout(4, 1)
    args = (
        DTensor.from_local(_local_heads(q), fake_mesh, [Shard(1)], run_check=False),
        DTensor.from_local(k, fake_mesh, [Replicate()], run_check=False),
        DTensor.from_local(v, fake_mesh, [Replicate()], run_check=False),
        DTensor.from_local(cq, fake_mesh, [Replicate()], run_check=False),
        DTensor.from_local(ck, fake_mesh, [Replicate()], run_check=False),
    )
    out = torch.ops.ragged_compile.ragged_attention(*args, False, 0.25)
    assert out.placements == (Replicate(),)


def _torchrun_example(tmp_path, *args: str, env: dict | None = None) -> dict:
    torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
    result = tmp_path / "result.json"
    cmd = (
        f"{torchrun} --standalone --nproc-per-node 2 {ROOT / 'examples' / 'train_fsdp.py'} "
        + " ".join(args) + f" --check --json {result}"
    )
    env = dict(os.environ, **(env or {}), PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(result.read_text())


def test_tensor_parallel_example_on_cpu_matches_one_process(tmp_path):
    """Two gloo ranks, heads split: same losses and weights as one process, and the
    only collectives are the projections' all-reduces (none in attention). The
    optimizer runs foreach, as it does by default on CUDA (sharded and plain
    parameters in one foreach group fail there)."""
    got = _torchrun_example(
        tmp_path, "--device cpu --mode tp --layers 2 --dim 64 --heads 4 --kv-heads 2",
        "--segments 3 --min-len 1 --max-len 12 --steps 2", env={"RC_EXAMPLE_FOREACH": "1"},
    )
    assert got["check"]["passed"], got["check"]
    assert got["graph_breaks"] == 0
    assert set(got["comm_counts"]) == {"c10d_functional.all_reduce"}, got["comm_counts"]


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs")
@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_two_gpu_training_matches_one_gpu(tmp_path, mode):
    got = _torchrun_example(tmp_path, f"--mode {mode} --steps 3")
    assert got["check"]["passed"], got["check"]
    assert got["graph_breaks"] == 0 and got["plans_per_forward"] == 1, got


def test_dropout_op_runs_replicated_not_head_sharded(fake_mesh):
    """The dropout pair is offered replicated only (each rank's generator would draw
    the same mask for its own heads): head-sharded inputs are gathered, and the
    replicated call equals the plain op under the same seed."""
    import ragged_compile.distributed  # noqa: F401
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    q, k, v, cq, ck = _layout(4, 2)
    r = [Replicate()]
    dq_, dk_, dv_, cu_q, cu_k = (DTensor.from_local(t, fake_mesh, r, run_check=False) for t in (q, k, v, cq, ck))
    torch.manual_seed(0)
    want = torch.ops.ragged_compile.ragged_attention_dropout(q, k, v, cq, ck, False, 0.25, 0.3)[0]
    torch.manual_seed(0)
    with CommDebugMode() as comms:
        out = torch.ops.ragged_compile.ragged_attention_dropout(dq_, dk_, dv_, cu_q, cu_k, False, 0.25, 0.3)[0]
    assert comms.get_total_counts() == 0 and out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), want)
    from torch.distributed.tensor import Shard

    sq, sk, sv = (DTensor.from_local(_local_heads(t), fake_mesh, [Shard(1)], run_check=False) for t in (q, k, v))
    with CommDebugMode() as comms:
        out = torch.ops.ragged_compile.ragged_attention_dropout(sq, sk, sv, cu_q, cu_k, False, 0.25, 0.3)[0]
    assert comms.get_total_counts() > 0 and out.placements == (Replicate(),)  # gathered, not run shard-local
