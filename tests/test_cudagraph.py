"""CUDA-graph mode: bucket choice, padding, re-planning and replay across layouts.

The state machines run on CPU in CI (same bookkeeping, no capture: the model is
called on the padded static buffers) and on CUDA with FlashInfer and real graph
replay (``RAGGED_GRAPH_STEPS`` sets the number of steps there).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import ragged_compile as rc
from ragged_compile.testing import layouts
from ragged_compile.buckets import Bucket, as_buckets, choose_bucket, pad_layout
from ragged_compile.cudagraph import GraphedModel, _indptr
from ragged_compile.reference import reference_attention, sees_key

BUCKETS = [(4, 64, 64), (16, 256, 192), (64, 640, 640)]
D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 16  # head_dim 16 pads to 64 on FlashInfer


def _ref_attention(q, k, v, cu_q, cu_k=None, *, causal=False):
    cu_k = cu_q if cu_k is None else cu_k
    out = reference_attention(q.float(), k.float(), v.float(), cu_q, cu_k, causal, q.shape[-1] ** -0.5)
    return out.to(q.dtype)


class Block(torch.nn.Module):
    """Causal self-attention, then (with kv) cross-attention, on packed tokens."""

    def __init__(self, attention=rc.ragged_attention):
        super().__init__()
        self.attention = attention
        hd = HEAD_DIM
        self.qkv = torch.nn.Linear(D_MODEL, (HEADS + 2 * KV_HEADS) * hd)
        self.q2 = torch.nn.Linear(D_MODEL, HEADS * hd)
        self.kv2 = torch.nn.Linear(D_MODEL, 2 * KV_HEADS * hd)
        self.o1 = torch.nn.Linear(HEADS * hd, D_MODEL)
        self.o2 = torch.nn.Linear(HEADS * hd, D_MODEL)

    def forward(self, x, cu, kv=None, cu_k=None):
        hd = HEAD_DIM
        q, k, v = self.qkv(x).split([HEADS * hd, KV_HEADS * hd, KV_HEADS * hd], -1)
        a = self.attention(
            q.unflatten(-1, (HEADS, hd)), k.unflatten(-1, (KV_HEADS, hd)), v.unflatten(-1, (KV_HEADS, hd)),
            cu, causal=True,
        )
        x = x + self.o1(a.flatten(1))
        if kv is not None:
            k2, v2 = self.kv2(kv).unflatten(-1, (2 * KV_HEADS, hd)).chunk(2, dim=1)
            a = self.attention(self.q2(x).unflatten(-1, (HEADS, hd)), k2, v2, cu, cu_k)
            x = x + self.o2(a.flatten(1))
        return x


def _models(device, dtype):
    torch.manual_seed(0)
    model = Block().to(device, dtype).eval()
    ref = Block(_ref_attention).to(device, torch.float32).eval()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _cu(lens, device="cpu"):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return cu.to(device)


def _expected_bucket(n, tq, tk):
    fitting = [Bucket(*b) for b in BUCKETS if n <= b[0] and tq <= b[1] and tk <= b[2]]
    return min(fitting, key=lambda b: (b.max_tokens_q + b.max_tokens_k, b.max_segments), default=None)


def make_machine(device: str, cross: bool, split_kv="auto"):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 5e-2 if device == "cuda" else 1e-5

    class GraphedMachine(RuleBasedStateMachine):
        @initialize()
        def setup(self):
            self.model, self.ref = _models(device, dtype)
            runtime = rc.Runtime(device)
            self.g = GraphedModel(self.model, BUCKETS, runtime=runtime, split_kv=split_kv)
            self.used: set[Bucket] = set()
            self.eager = 0
            self.last = None
            self.gen = torch.Generator(device=device).manual_seed(1)

        def _run(self, q_lens, kv_lens):
            q_lens, kv_lens = list(q_lens), list(kv_lens)
            x = torch.randn(sum(q_lens), D_MODEL, device=device, generator=self.gen).to(dtype)
            cu = _cu(q_lens)  # host offsets: the no-sync path
            args = (x, cu)
            if cross:
                kv = torch.randn(sum(kv_lens), D_MODEL, device=device, generator=self.gen).to(dtype)
                args = (x, cu, kv, _cu(kv_lens))
            out = self.g(*args)
            dev_args = tuple(a.to(device) if a.dtype.is_floating_point is False else a.float() for a in args)
            with torch.no_grad():
                want = self.ref(*dev_args)
            assert out.shape == x.shape and out.dtype == dtype
            assert torch.isfinite(out).all()
            if out.numel():
                err = (out.float() - want).abs().max().item()
                assert err < tol, (err, q_lens, kv_lens)
            b = _expected_bucket(len(q_lens), sum(q_lens), sum(kv_lens))
            if b is None or sum(q_lens) == 0:
                self.eager += 1
            else:
                self.used.add(b)
            self.last = (q_lens, kv_lens)

        @rule(layout=layouts(max_segments=80, max_len=160, cross=cross, max_tokens=700, max_tiny_segments=4096))
        def step(self, layout):
            self._run(layout.q_lengths, layout.k_lengths if cross else layout.q_lengths)

        @precondition(lambda self: self.last is not None and len(self.last[0]) > 1)
        @rule(data=st.data())
        def same_totals_other_layout(self, data):
            q_lens, kv_lens = self.last
            perm = data.draw(st.permutations(range(len(q_lens))))
            q2 = [q_lens[i] for i in perm]
            kv2 = [kv_lens[i] for i in perm] if cross else q2
            self._run(q2, kv2)

        @rule(which=st.integers(0, len(BUCKETS) - 1), ones=st.booleans())
        def full_bucket(self, which, ones):
            S, tq, tk = BUCKETS[which]
            def spread(total):
                lens = [total // S] * S
                lens[-1] += total - sum(lens)
                return lens
            q_lens = spread(tq)
            if ones:  # one-token segments plus one long one, still exactly full
                q_lens = [1] * (S - 1) + [tq - (S - 1)]
            self._run(q_lens, spread(tk) if cross else q_lens)

        @invariant()
        def bookkeeping(self):
            if not hasattr(self, "g"):
                return
            assert set(self.g.entries) == self.used
            assert self.g.stats["eager"] == self.eager
            if device == "cuda":
                assert self.g.stats["captures"] == len(self.used)  # never a recapture
                assert self.g.stats["syncs"] == 0

    return GraphedMachine


def _machine_settings(device):
    if device == "cuda":
        steps = int(os.environ.get("RAGGED_GRAPH_STEPS", "1000"))
        return settings(max_examples=max(1, steps // 50), stateful_step_count=50, deadline=None)
    return settings(max_examples=12, stateful_step_count=8, deadline=None)


@pytest.mark.parametrize("cross", [False, True])
def test_state_machine_cpu(cross):
    m = make_machine("cpu", cross)
    m.TestCase.settings = _machine_settings("cpu")
    m.TestCase().runTest()


@pytest.mark.cuda
@pytest.mark.parametrize("split_kv", [False, True])  # "auto" picks False for these buckets
@pytest.mark.parametrize("cross", [False, True])
def test_state_machine_cuda(cross, split_kv):
    m = make_machine("cuda", cross, split_kv)
    m.TestCase.settings = _machine_settings("cuda")
    m.TestCase().runTest()


# -- pure bookkeeping -----------------------------------------------------------


@given(layout=layouts(max_segments=80, max_len=200, max_tokens=None, max_tiny_segments=0))
def test_pad_layout_keeps_real_segments_and_pads_to_the_ceiling(layout):
    buckets = as_buckets(BUCKETS)
    b = choose_bucket(buckets, layout.n, layout.total_q, layout.total_k)
    assert b == _expected_bucket(layout.n, layout.total_q, layout.total_k)
    small = Bucket(max(layout.n - 1, 1), max(layout.total_q - 1, 1), max(layout.total_k - 1, 1))
    if not small.fits(layout.n, layout.total_q, layout.total_k):
        with pytest.raises(ValueError, match="does not fit"):
            pad_layout(small, _cu(layout.q_lengths), _cu(layout.k_lengths))
    if b is None:
        return
    p = pad_layout(b, _cu(layout.q_lengths), _cu(layout.k_lengths))
    S = b.max_segments
    assert p.cu_q.shape == (S + 2,) and p.cu_k.shape == (S + 2,)
    assert p.cu_q[: layout.n + 1].tolist() == _cu(layout.q_lengths).tolist()
    assert p.cu_q[layout.n + 1 : S + 1].eq(layout.total_q).all()
    assert int(p.cu_q[-1]) == b.max_tokens_q and int(p.cu_k[-1]) == b.max_tokens_k
    # The padding segment's rows see no key: graph mode relies on that for them.
    for causal in (False, True):
        qo, kv = _indptr(p, ("q", "k"))
        sees = sees_key(qo.long(), kv.long(), b.max_tokens_q, causal)
        assert not sees[layout.total_q :].any()
        assert sees[: layout.total_q].tolist() == sees_key(
            _cu(layout.q_lengths), _cu(layout.k_lengths), layout.total_q, causal
        ).tolist()


def test_buckets_are_validated():
    with pytest.raises(ValueError, match="max_segments"):
        as_buckets([(0, 10)])
    with pytest.raises(ValueError, match="at least one"):
        as_buckets([])
    with pytest.raises(ValueError, match=r"\(max_segments, max_tokens_q"):
        as_buckets([(1, 2, 3, 4)])


def test_graphed_rejects_bad_offsets_and_mismatched_cross_args():
    model, _ = _models("cpu", torch.float32)
    g = GraphedModel(model, BUCKETS, runtime=rc.Runtime("cpu"))
    x = torch.randn(10, D_MODEL)
    with pytest.raises(ValueError, match="cu_seqlens"):
        g(x, torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="together"):
        g(x, torch.tensor([0, 10]), x)
    with pytest.raises(ValueError, match="split_kv"):
        GraphedModel(model, BUCKETS, runtime=rc.Runtime("cpu"), split_kv="yes")


# -- per-segment outputs ---------------------------------------------------------


class Pooled(torch.nn.Module):
    """An embedding model: attention, then the mean of each segment's tokens.

    Returns ``(tokens [T, E], pooled [segments, E])``; an empty segment's mean is
    NaN (0 / 0), as in a plain implementation."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, cu):
        h = self.block(x, cu)
        cu = cu.long()
        seg = torch.searchsorted(cu[1:], torch.arange(h.shape[0], device=h.device), right=True)
        sums = torch.zeros(cu.numel() - 1, h.shape[1], dtype=torch.float32, device=h.device)
        sums.index_add_(0, seg, h.float())
        counts = (cu[1:] - cu[:-1]).to(torch.float32)[:, None]
        return h, (sums / counts).to(h.dtype)


def _pooled_models(device, dtype):
    torch.manual_seed(0)
    model = Pooled().to(device, dtype).eval()
    ref = Pooled().to(device, torch.float32).eval()
    ref.block.attention = _ref_attention
    ref.load_state_dict(model.state_dict())
    return model, ref


@pytest.mark.parametrize("outputs", [None, ("tokens", "segments")])
def test_graphed_pooled_model_returns_the_real_segments_rows(outputs, device="cpu"):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 5e-2 if device == "cuda" else 1e-5
    model, ref = _pooled_models(device, dtype)
    g = rc.Runtime(device).graphed(model, [(8, 64), (16, 256)], outputs=outputs)
    gen = torch.Generator().manual_seed(0)
    for lens in ([5, 1, 9], [30, 30, 30, 30], [7, 0, 3], [1] * 16, [100] * 3):
        x = torch.randn(sum(lens), D_MODEL, generator=gen).to(device, dtype)
        tokens, pooled = g(x, _cu(lens))
        assert tokens.shape == (sum(lens), D_MODEL)
        assert pooled.shape == (len(lens), D_MODEL)  # not the bucket's segments + 1
        with torch.no_grad():
            want_tokens, want_pooled = ref(x.float(), _cu(lens, device))
        assert (tokens.float() - want_tokens).abs().max().item() < tol
        real = torch.tensor(lens) > 0  # an empty segment's mean is NaN in both
        assert torch.isnan(pooled[~real]).all() and torch.isnan(want_pooled[~real]).all()
        assert (pooled[real].float() - want_pooled[real]).abs().max().item() < tol
    assert g.stats["replays"] == 4 and g.stats["eager"] == 1  # [100] * 3 fits no bucket


@pytest.mark.cuda
@pytest.mark.parametrize("outputs", [None, ("tokens", "segments")])
def test_graphed_pooled_model_returns_the_real_segments_rows_cuda(outputs):
    test_graphed_pooled_model_returns_the_real_segments_rows(outputs, device="cuda")


def test_real_rows_by_declaration_and_its_errors():
    from ragged_compile.cudagraph import real_rows

    out = {"tok": torch.arange(10.0)[:, None], "seg": torch.arange(5.0)[:, None], "loss": torch.tensor(3.0)}
    got = real_rows(out, None, rows=10, segments=5, total_q=7, n=3)
    assert got["tok"].shape[0] == 7 and got["seg"].shape[0] == 3 and got["loss"].item() == 3.0
    assert got["tok"].data_ptr() != out["tok"].data_ptr()  # copies: a replay overwrites the originals
    spec = {"tok": "whole", "seg": "segments", "loss": "whole"}
    assert real_rows(out, spec, rows=10, segments=5, total_q=7, n=3)["tok"].shape[0] == 10
    with pytest.raises(ValueError, match=r"declared 'tokens'.*outputs="):
        real_rows(out["seg"], "tokens", rows=10, segments=5, total_q=7, n=3)
    # A bucket whose token rows equal its segments + 1 cannot tell them apart.
    with pytest.raises(ValueError, match=r"outputs='tokens' or 'segments'"):
        real_rows(torch.zeros(5, 2), None, rows=5, segments=5, total_q=4, n=2)
    assert real_rows(torch.zeros(5, 2), "segments", rows=5, segments=5, total_q=4, n=2).shape[0] == 2
    model, _ = _models("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"outputs must be one of"):
        rc.Runtime("cpu").graphed(model, BUCKETS, outputs="rows")
    with pytest.raises(TypeError, match=r"rc\.Runtime\(\)\.graphed"):
        GraphedModel(model, BUCKETS, runtime=None)


# -- CUDA only ----------------------------------------------------------------


@pytest.mark.cuda
def test_thousand_layouts_one_capture_per_bucket_no_recompile():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, ref = _models("cuda", torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    runtime = rc.Runtime()
    g = runtime.graphed(compiled, [(64, 640)])
    gen = torch.Generator().manual_seed(0)
    for i in range(1000):
        n = int(torch.randint(1, 65, (), generator=gen))
        total = int(torch.randint(n, 641, (), generator=gen))
        cuts = torch.sort(torch.randint(0, total + 1, (n - 1,), generator=gen)).values.tolist()
        lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        x = torch.randn(total, D_MODEL, device="cuda").to(torch.bfloat16)
        out = g(x, _cu(lens))
        if i % 50 == 0:
            want = ref(x.float(), _cu(lens, "cuda"))
            assert (out.float() - want).abs().max().item() < 5e-2
    assert g.stats["captures"] == 1 and g.stats["replays"] == 1000
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.cuda
def test_poisoned_pool_and_padding_rows_never_reach_outputs():
    model, ref = _models("cuda", torch.bfloat16)
    g = rc.Runtime().graphed(model, [(8, 256)])
    lens = [30, 0, 1, 90]
    x = torch.randn(sum(lens), D_MODEL, device="cuda").to(torch.bfloat16)
    g(x, _cu(lens))  # capture
    e = g.entries[as_buckets([(8, 256)])[0]]
    # NaN/Inf everywhere the graph could read stale memory: static inputs, the
    # caching allocator's free blocks, FlashInfer's float workspace.
    e.x.fill_(float("nan"))
    junk = torch.full((64 << 20,), float("inf"), device="cuda")
    del junk
    g.runtime.workspace().fill_(0xFF)
    for lens in ([3, 100, 0, 1, 1, 50], [255], [1] * 8):
        x = torch.randn(sum(lens), D_MODEL, device="cuda").to(torch.bfloat16)
        out = g(x, _cu(lens))
        assert torch.isfinite(out).all()
        want = ref(x.float(), _cu(lens, "cuda"))
        assert (out.float() - want).abs().max().item() < 5e-2


@pytest.mark.cuda
def test_graph_mode_rejects_float32_clearly():
    model, _ = _models("cuda", torch.float32)
    g = rc.Runtime().graphed(model, [(8, 64)])
    with pytest.raises(ValueError, match="float16/bfloat16"):
        g(torch.randn(10, D_MODEL, device="cuda"), _cu([4, 6]))


@pytest.mark.cuda
def test_over_bucket_runs_eagerly_without_sync():
    model, ref = _models("cuda", torch.bfloat16)
    runtime = rc.Runtime()
    g = runtime.graphed(model, [(4, 64)])
    lens = [20, 30, 40]
    x = torch.randn(sum(lens), D_MODEL, device="cuda").to(torch.bfloat16)
    out = g(x, _cu(lens))
    assert g.stats["eager"] == 1 and g.stats["captures"] == 0 and runtime.stats["syncs"] == 0
    want = ref(x.float(), _cu(lens, "cuda"))
    assert (out.float() - want).abs().max().item() < 5e-2


def test_workspace_shortfall_reads_flashinfers_overflow_message():
    from ragged_compile.backends.flashinfer import workspace_shortfall

    # The message FlashInfer 0.7.2 gave on the H200 when a graph-mode plan for a
    # bucket of 256 segments / 34000 tokens outgrew a 256 MiB workspace.
    err = RuntimeError(
        "Error in function 'aligned_alloc' at flashinfer/allocator.h:71: Buffer overflow when "
        "allocating memory for batch_prefill_tmp_v with size 547356672 and alignment 16, but only "
        "268435456 bytes available in AlignedAllocator. Increase the workspace buffer size."
    )
    assert workspace_shortfall(err) == 547356672 + 268435456
    assert workspace_shortfall(RuntimeError("something else")) is None


@pytest.mark.cuda
def test_reduce_overhead_keeps_every_layout_correct():
    """torch.compile(mode="reduce-overhead") graphs what surrounds the op (tagged
    cudagraph_unsafe) and never freezes a plan: equal shapes, different layouts,
    every output right."""
    import torch._dynamo

    torch._dynamo.reset()
    model, ref = _models("cuda", torch.bfloat16)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    runtime = rc.Runtime(backend="fa2")  # FlashInfer: what plans
    gen = torch.Generator(device="cuda").manual_seed(0)
    for lens in ([30, 34], [1, 63], [63, 1], [32, 32], [1, 63]):
        x = torch.randn(64, D_MODEL, device="cuda", generator=gen).to(torch.bfloat16)
        with torch.no_grad(), runtime.step(lens):  # inference: the cudagraph fast path
            out = compiled(x, _cu(lens, "cuda")).clone()
            want = ref(x.float(), _cu(lens, "cuda"))
        assert (out.float() - want).abs().max().item() < 5e-2, lens
    assert runtime.stats["flashinfer"] == 5 and runtime.stats["reference"] == 0


def test_runtime_and_cudagraph_depend_one_way_with_no_private_names():
    import ast
    import pathlib

    pkg = pathlib.Path(rc.__file__).parent

    def imports(name, top_level=False):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        nodes = tree.body if top_level else ast.walk(tree)
        return [n for n in nodes if isinstance(n, ast.ImportFrom) and n.level == 1]

    # Graph mode builds on the runtime; the runtime imports it only when graphed() is called.
    assert not any(n.module == "cudagraph" for n in imports("runtime", top_level=True))
    assert any(n.module == "runtime" for n in imports("cudagraph", top_level=True))
    for name in ("runtime", "cudagraph"):
        for node in imports(name):
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{name}.py imports private {private} from .{node.module}"
