"""ragged_compile next to the wrappers training and deployment code puts around models.

* distributed: ``DDP(rc.compile(m))`` and ``rc.compile(DDP(m))``, FSDP2
  (``fully_shard``) per block and around the compiled model, on one gloo rank;
  our backend is recognised through every wrapper Dynamo puts around it;
* ``torch.utils.checkpoint`` (reentrant or not) under ``enable()``,
  ``rc.compile`` and ``inference_mode``: the recompute runs what the forward ran;
* a failing first call (a user error) leaves the model as dynamic as before and
  keeps its reason;
* ``copy.deepcopy``, pickle and ``torch.save`` copies of a compiled module;
* ``torch.jit.trace`` of a packed model;
* the CPU kernel with ``scale <= 0``.

Which implementation ran is counted: on CPU every call of our op runs the fused
CPU kernel (or the reference, float64), which a spy counts per thread.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import pickle
import threading
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _njt_models import SelfAttentionLayer, dense_reference, encoder, njt, random_layouts
from torch import nn

import ragged_compile as rc
from ragged_compile import logs as rc_logs
from ragged_compile import njt as rc_njt
from ragged_compile.reference import dense_attention, dense_gradients

E, H = 32, 4
counters = torch._dynamo.utils.counters
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class Block(nn.Module):
    """Pre-norm encoder block with separate q/k/v projections (contiguous heads).

    ``enable_gqa`` is a constant: under FSDP2 Dynamo traces module int attributes
    symbolically, and SDPA's argument parser takes no SymBool.
    """

    def __init__(self, causal: bool = False, kv_heads: int = H):
        super().__init__()
        self.causal, self.kv_heads, self.d = causal, kv_heads, E // H
        self.norm = nn.LayerNorm(E)
        self.q = nn.Linear(E, E)
        self.k = nn.Linear(E, kv_heads * self.d)
        self.v = nn.Linear(E, kv_heads * self.d)
        self.out = nn.Linear(E, E)

    def forward(self, x):
        h = self.norm(x)
        q = self.q(h).unflatten(-1, [H, self.d]).transpose(1, 2)
        k = self.k(h).unflatten(-1, [self.kv_heads, self.d]).transpose(1, 2)
        v = self.v(h).unflatten(-1, [self.kv_heads, self.d]).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        return x + self.out(a.transpose(1, 2).flatten(-2))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block(causal=True), Block(kv_heads=2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _loss(out):
    return out.values().square().sum()


def _eager_grads(model, x):
    """Parameter gradients of an eager run on our op (the reference for wrapped runs)."""
    ref = copy.deepcopy(model)
    with rc.enable():
        _loss(ref(x)).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_grads(model, want):
    got = {n.replace("_orig_mod.", "").replace("module.", ""): p.grad for n, p in model.named_parameters()}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for n, g in want.items():
        assert got[n] is not None, n
        torch.testing.assert_close(_full(got[n]), g, atol=2e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------- 1: distributed wrappers


@pytest.fixture
def gloo(tmp_path):
    """One gloo rank (world size 1) on a file store."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_ddp_around_rc_compile_runs_our_op(gloo, ours, backend):
    """DDP(rc.compile(m)), the usual order in training scripts: Dynamo's DDPOptimizer
    wraps our backend in a bound method of its own, and the rewrite still applies:
    fullgraph, our op forward (one call per block), the eager gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Encoder().train()
    x = njt([3, 5, 2, 7], E)
    want = _eager_grads(model, x)
    ddp = DDP(rc.compile(model, backend=backend, fullgraph=True))
    ours.n = 0
    out = ddp(x)
    assert ours.n == 3
    _loss(out).backward()
    _assert_grads(ddp, want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    with torch.no_grad():
        torch.testing.assert_close(ddp(x).values(), dense_reference(model, x), atol=1e-5, rtol=1e-5)


def test_ddp_around_rc_compile_new_layouts_share_the_graph(gloo, ours):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(rc.compile(Encoder().train(), backend="aot_eager"))
    for lens in random_layouts(6, seed=1):
        ours.n = 0
        _loss(ddp(njt(lens, E))).backward()
        assert ours.n == 3
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_rc_compile_around_ddp_runs_our_op(gloo, ours):
    """rc.compile(DDP(m)): Dynamo graph-breaks in DDP's own forward (as for plain
    torch.compile) and compiles the module inside for our backend."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Encoder().train()
    x = njt([3, 5, 2, 7], E)
    want = _eager_grads(model, x)
    compiled = rc.compile(DDP(model), backend="aot_eager")
    ours.n = 0
    _loss(compiled(x)).backward()
    assert ours.n == 3
    _assert_grads(compiled, want)


def test_ddp_around_plain_torch_compile_keeps_stock(gloo, ours):
    """The other way round: DDP(torch.compile(m)) never gets our op (what runs
    eagerly around its graph breaks follows enable(), as for any plain compile)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Contiguous(nn.Module):  # q = k = v: stock NJT SDPA runs on CPU
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(E, E)

        def forward(self, x):
            q = self.proj(x).unflatten(-1, [H, E // H]).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2)

    ddp = DDP(torch.compile(Contiguous(), backend="aot_eager"))
    x = njt([3, 5, 2], E)
    with torch.no_grad():
        ddp(x)
    assert ours.n == 0


def _fsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_fsdp2_per_block_rc_compile(gloo, ours):
    """The FSDP2 recipe of examples/train_fsdp.py: fully_shard each block, compile it
    with rc.compile(fullgraph=True), fully_shard the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = _fsdp_mesh()
    model = Encoder().train()
    x = njt([3, 5, 2, 7], E)
    want = _eager_grads(model, x)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh)
        model.blocks[i] = rc.compile(block, backend="aot_eager", fullgraph=True)
    fully_shard(model, mesh=mesh)
    ours.n = 0
    _loss(model(x)).backward()
    assert ours.n == 3
    _assert_grads(model, want)


@pytest.mark.parametrize("order", ["fsdp_outside", "fsdp_inside"])
def test_fsdp2_around_or_inside_rc_compile(gloo, ours, order):
    """fully_shard(rc.compile(m)) and rc.compile(fully_shard(m)) run our op too
    (the latter graph-breaks at FSDP's hooks, as plain torch.compile does)."""
    from torch.distributed.fsdp import fully_shard

    mesh = _fsdp_mesh()
    model = Encoder().train()
    x = njt([3, 5, 2, 7], E)
    want = _eager_grads(model, x)
    if order == "fsdp_outside":
        wrapped = fully_shard(rc.compile(model, backend="aot_eager"), mesh=mesh)
    else:
        wrapped = rc.compile(fully_shard(model, mesh=mesh), backend="aot_eager")
    ours.n = 0
    _loss(wrapped(x)).backward()
    assert ours.n == 3
    _assert_grads(wrapped, want)


def test_backend_recognised_through_dynamo_wrappers():
    """Every wrapper torch._dynamo puts around a backend, alone and nested; a
    foreign backend is never taken for ours, and odd objects cannot break the walk."""
    from torch._dynamo.backends.distributed import DDPOptimizer, SubmodCompiler
    from torch._dynamo.output_graph import WrapperBackend, _wrap_with_inductor_config
    from torch._dynamo.repro.after_dynamo import WrapBackendDebug

    from ragged_compile.compiler import _backend

    mine = _backend("aot_eager", None, None, None, None)
    plain = torch._TorchCompileWrapper("aot_eager", "default", None, None)

    def closure_of(fn):
        def wrapper(gm, example_inputs, **kwargs):
            return fn(gm, example_inputs, **kwargs)

        return wrapper

    wrappers = {
        "debug": lambda b: WrapBackendDebug(b, "aot_eager"),
        "partial": lambda b: functools.partial(b, extra=1),
        "ddp_optimizer": lambda b: DDPOptimizer(bucket_bytes_cap=1 << 20, backend_compile_fn=b).compile_fn,
        "verify_correctness": WrapperBackend,
        "inductor_config_override": lambda b: _wrap_with_inductor_config(b, {}),
        "closure": closure_of,
        "submod_compiler": lambda b: SubmodCompiler(torch.fx.symbolic_trace(nn.Identity()), b, None).run,
    }
    for name, wrap in wrappers.items():
        assert rc_njt._is_ours(wrap(mine)), name
        assert not rc_njt._is_ours(wrap(plain)), name
    nested = mine
    for wrap in wrappers.values():
        nested = wrap(nested)
    assert rc_njt._is_ours(nested)

    class Cycle:
        pass

    a, b = Cycle(), Cycle()
    a.backend, b.backend = b, a
    assert not rc_njt._is_ours(a)

    class Hostile:
        def __getattr__(self, name):
            raise RuntimeError("no attributes here")

    assert not rc_njt._is_ours(Hostile())
    assert not rc_njt._is_ours(None)


@pytest.mark.cuda
def test_cuda_ddp_around_rc_compile_runs_our_op(tmp_path, monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ragged_compile.runtime import Runtime

    calls = []
    real = Runtime.attention_with_lse

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Runtime, "attention_with_lse", spy)
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = Encoder().cuda().to(torch.bfloat16).train()
        ddp = DDP(rc.compile(model, fullgraph=True))
        x = torch.nested.nested_tensor(
            [torch.randn(n, E, device="cuda", dtype=torch.bfloat16) for n in (17, 3, 64)], layout=torch.jagged
        )
        _loss(ddp(x)).float().backward()
        torch.cuda.synchronize()
        assert len(calls) == 3
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- 2: activation checkpointing


def _layer(causal):
    torch.manual_seed(0)
    return SelfAttentionLayer(E, H, causal=causal)  # k/v from one chunked projection: stock fails on CPU


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_checkpoint_recompute_outside_enable_runs_our_op(ours, reentrant, causal):
    """Only the forward inside enable(), backward() outside it: the recompute runs
    our op as the forward did, and the gradients are those without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    layer = _layer(causal)
    x = njt([3, 5, 2, 7], E)
    x.requires_grad_(True)
    ref = copy.deepcopy(layer)
    with rc.enable():
        _loss(ref(x)).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    want_x = x.grad.values().clone()
    x.grad = None

    ours.n = 0
    with rc.enable():
        out = checkpoint(layer, x, use_reentrant=reentrant)
    assert ours.n == 1
    _loss(out).backward()
    assert ours.n == 2, "the recompute ran stock NJT SDPA"
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=lambda m: f"{n}: {m}")
    torch.testing.assert_close(x.grad.values(), want_x)


def test_checkpoint_recompute_inside_enable_of_stock_forward_stays_stock(ours):
    """The other way round: a stock forward, backward() inside enable(); the recompute
    runs stock, as its forward did. Reentrant only: torch's non-reentrant checkpoint
    cannot save what stock NJT SDPA's CPU math path makes (strided nested tensors)."""
    from torch.utils.checkpoint import checkpoint

    rc_njt.install()  # as any use of ragged_compile before this forward would have

    class Contiguous(nn.Module):  # q = k = v: stock NJT SDPA trains on CPU
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = nn.Linear(E, E)

        def forward(self, x):
            q = self.proj(x).unflatten(-1, [H, E // H]).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2)

    layer = Contiguous()
    x = njt([3, 5, 2], E)
    x.requires_grad_(True)
    out = checkpoint(layer, x, use_reentrant=True)
    with rc.enable():
        _loss(out).backward()
    assert ours.n == 0
    assert layer.proj.weight.grad is not None


def test_checkpoint_in_a_model_compiled_by_rc_compile(ours):
    """checkpoint inside a model compiled by rc.compile: Dynamo traces it as a region
    whose recompute is part of the compiled backward, on our op."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Encoder()

        def forward(self, x):
            for block in self.inner.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    model = Checkpointed().train()
    x = njt([3, 5, 2, 7], E)
    want = _eager_grads(model, x)
    compiled = rc.compile(model, backend="aot_eager", fullgraph=True)
    ours.n = 0
    _loss(compiled(x)).backward()
    assert ours.n == 6  # the forward's 3 calls, and the recompute's in the compiled backward
    _assert_grads(compiled, want)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_of_an_rc_compiled_layer(ours, reentrant):
    """checkpoint(rc.compile(layer), x) outside any enable(): forward and recompute
    both run the compiled code, on our op."""
    from torch.utils.checkpoint import checkpoint

    layer = _layer(causal=True)
    x = njt([3, 5, 2, 7], E)
    x.requires_grad_(True)
    want = _eager_grads(layer, x)
    x.grad = None
    compiled = rc.compile(layer, backend="aot_eager")
    ours.n = 0
    out = checkpoint(compiled, x, use_reentrant=reentrant)
    _loss(out).backward()
    assert ours.n == 2
    _assert_grads(compiled, want)


def test_inference_mode_with_enable_and_rc_compile(ours):
    model = encoder(E, H)
    x = njt([3, 5, 2, 7], E)
    with torch.no_grad():
        want = dense_reference(model, x)
    compiled = rc.compile(model, backend="aot_eager")
    with torch.inference_mode():
        with rc.enable():
            eager = model(x)
        assert ours.n == 3
        got = compiled(x)
        # checkpoint under inference_mode does not checkpoint: nothing to recompute
        with rc.enable():
            ckpt = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    assert ours.n == 9
    for out in (eager, got, ckpt):
        torch.testing.assert_close(out.values(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("reentrant", [False, True])
def test_cuda_checkpoint_recompute_outside_enable_runs_our_op(monkeypatch, reentrant):
    """On CUDA the recompute runs on autograd's device thread, whose context never saw enable()."""
    from torch.utils.checkpoint import checkpoint

    from ragged_compile.runtime import Runtime

    calls = []

    def spy(name):
        real = getattr(Runtime, name)

        def run(self, *args, **kwargs):
            calls.append((name, threading.get_ident()))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Runtime, name, run)

    # Reentrant checkpointing runs the forward under no_grad (the inference
    # kernel); the recompute, with grad, runs the training kernel either way.
    spy("attention")
    spy("attention_with_lse")
    torch.manual_seed(0)
    layer = SelfAttentionLayer(256, 4, causal=True).cuda().to(torch.bfloat16)
    x = torch.nested.nested_tensor(
        [torch.randn(n, 256, device="cuda", dtype=torch.bfloat16) for n in (17, 3, 64)], layout=torch.jagged
    )
    x.requires_grad_(True)
    with rc.enable():
        out = checkpoint(layer, x, use_reentrant=reentrant)
    _loss(out).float().backward()
    torch.cuda.synchronize()
    forward = "attention" if reentrant else "attention_with_lse"
    assert [name for name, _ in calls] == [forward, "attention_with_lse"], "the recompute ran stock NJT SDPA"
    assert all(p.grad is not None for p in layer.parameters())


# ---------------------------------------------------------------- 3: a failing call leaves the model as it was


def _attn(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _qkv(lens, dv=8, seed=None):
    """q, k of head dim 8 and v of head dim ``dv`` from one NJT (one offsets tensor)."""
    h = njt(lens, H * 16, seed=seed).unflatten(-1, [H, 16])
    return h[..., :8].transpose(1, 2), h[..., 8:].transpose(1, 2), h[..., 16 - dv :].transpose(1, 2)


def _graphs_over(f, layouts):
    counters.clear()
    with torch.no_grad():
        for lens in layouts:
            f(*_qkv(lens))
    return counters["stats"]["unique_graphs"]


def test_user_error_in_the_first_call_leaves_the_model_dynamic(caplog, monkeypatch):
    """A v head dim that differs from q's, fullgraph: stock NJT SDPA fails at trace time
    on a data-dependent size, which is no reason to give up unbacked min/max lengths:
    the error propagates with its reason, and 30 layouts then compile as many graphs
    as on a fresh model."""
    monkeypatch.setattr(rc_logs, "_seen", set())  # warnings are once per process
    layouts = random_layouts(30)
    fresh = _graphs_over(rc.compile(_attn, backend="aot_eager", fullgraph=True), layouts)
    torch._dynamo.reset()

    f = rc.compile(_attn, backend="aot_eager", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        with pytest.raises(Exception) as info, torch.no_grad():
            f(*_qkv([3, 5, 2], dv=16))
    text = "".join(traceback.format_exception_only(info.value))
    assert "left to stock NJT SDPA because q, k and v head dims differ" in text, text
    assert not [r for r in caplog.records if "symbolic" in r.getMessage()], [
        r.getMessage() for r in caplog.records if r.name == "ragged_compile"
    ]
    assert _graphs_over(f, layouts) == fresh


def test_fullgraph_fallback_reason_is_on_the_raised_error():
    """Dynamo wraps the exception stock raised (which carries our reason as a note)
    in its own; the one the caller gets says why the call was left to stock."""

    def attn(x, y):
        q = x.unflatten(-1, [H, 8]).transpose(1, 2)
        v = y.unflatten(-1, [H, 16]).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, v)

    f = rc.compile(attn, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as info, torch.no_grad():
        f(njt([3, 5, 2], H * 8), njt([3, 5, 2], H * 16))
    text = "".join(traceback.format_exception_only(info.value))
    assert "left to stock NJT SDPA because q, k and v head dims differ" in text, text


def test_real_unbacked_failure_keeps_lengths_backed_once(caplog, monkeypatch):
    """A model that guards on the max length does need it backed: one WARNING, and
    it runs (and keeps running) correctly."""
    monkeypatch.setattr(rc_logs, "_seen", set())  # warnings are once per process

    def f(x):
        if x._get_max_seqlen() > 4:
            return x * 2
        return x * 3

    g = rc.compile(f, backend="aot_eager", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        for lens, factor in (([3, 5, 2], 2), ([1, 2], 3), ([7, 7], 2), ([2, 3], 3)):
            x = njt(lens, 8)
            torch.testing.assert_close(g(x).values(), x.values() * factor)
    warned = [r for r in caplog.records if "symbolic" in r.getMessage()]
    assert len(warned) == 1


# ---------------------------------------------------------------- 4: copies


def _deepcopy(m):
    return copy.deepcopy(m)


def _pickle(m):
    return pickle.loads(pickle.dumps(m))


def _torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _layouts_graphs(m, layouts):
    torch._dynamo.reset()
    counters.clear()
    outs = []
    with torch.no_grad():
        for lens in layouts:
            outs.append(m(njt(lens, E)).values())
    return counters["stats"]["unique_graphs"], outs


@pytest.mark.parametrize("how", [_deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch.save"])
def test_copies_of_a_compiled_module_behave_as_the_original(ours, how):
    layouts = random_layouts(30)
    original = rc.compile(encoder(E, H), backend="aot_eager")
    graphs, outs = _layouts_graphs(original, layouts)
    clone = how(original)
    assert clone is not original and clone._orig_mod is not original._orig_mod
    ours.n = 0
    clone_graphs, clone_outs = _layouts_graphs(clone, layouts)
    assert ours.n == 3 * len(layouts)
    assert clone_graphs == graphs
    for a, b in zip(outs, clone_outs):
        torch.testing.assert_close(a, b)


def test_copies_keep_what_the_model_learned():
    """A model that needs backed lengths: its copy starts from that, and goes its own way."""
    original = rc.compile(nn.Identity(), backend="aot_eager")
    original.dynamo_ctx.state["unbacked"] = False
    clone = copy.deepcopy(original)
    assert clone.dynamo_ctx.state == {"unbacked": False}
    assert clone.dynamo_ctx.state is not original.dynamo_ctx.state
    assert clone.dynamo_ctx.fullgraph == original.dynamo_ctx.fullgraph  # Dynamo's context's own


# ---------------------------------------------------------------- 5: torch.jit.trace


class Packed(nn.Module):
    def __init__(self, max_seqlen=None):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(E, 3 * E)
        self.max_seqlen = max_seqlen

    def forward(self, x, cu):
        q, k, v = self.proj(x).unflatten(-1, [3, H, E // H]).unbind(1)
        out = rc.ragged_attention(q, k, v, cu, causal=True, max_seqlen_q=self.max_seqlen)
        return out.flatten(-2)


@pytest.mark.parametrize("max_seqlen", [None, 5])
def test_jit_trace_of_a_packed_model_is_quiet(max_seqlen):
    model = Packed(max_seqlen).requires_grad_(False)
    x, cu = torch.randn(10, E), torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, (x, cu))
    ours = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning) and "validation.py" in w.filename]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    x2, cu2 = torch.randn(7, E), torch.tensor([0, 2, 7], dtype=torch.int32)
    torch.testing.assert_close(traced(x2, cu2), model(x2, cu2))


def test_jit_trace_still_checks_sizes_and_offsets():
    """The checks skipped while tracing run in the op's kernel: on the example inputs,
    and at every run of the trace."""
    model = Packed().requires_grad_(False)
    bad = torch.randn(10, E)[:, : E - 8]
    with pytest.raises(Exception, match="mat1 and mat2|shapes cannot be multiplied"):
        torch.jit.trace(model, (bad, torch.tensor([0, 3, 8, 10], dtype=torch.int32)))

    def f(q, k, v, cu):
        return rc.ragged_attention(q, k, v, cu)

    q = torch.randn(10, H, 8)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    with pytest.raises(Exception, match="must share head_dim"):
        torch.jit.trace(f, (q, q, torch.randn(10, H, 4), cu))
    traced = torch.jit.trace(f, (q, q, q, cu))
    with pytest.raises(Exception, match="must share head_dim"):
        traced(q, q, torch.randn(10, H, 4), cu)
    with pytest.raises(Exception, match=r"cu_seqlens_q\[-1\] is 9 but q holds 10 tokens"):
        traced(q, q, q, torch.tensor([0, 3, 8, 9], dtype=torch.int32))


@pytest.mark.cuda
def test_cuda_jit_trace_records_the_op_and_checks_at_every_run():
    """On CUDA the trace must record the op (whose kernel checks sizes at every run),
    not the runtime calls an eager call makes without the dispatcher."""
    model = Packed().cuda().half().requires_grad_(False)
    x = torch.randn(10, E, device="cuda", dtype=torch.half)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, (x, cu))
    assert "ragged_compile::ragged_attention" in str(traced.graph), traced.graph
    ours = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning) and "validation.py" in w.filename]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    x2 = torch.randn(7, E, device="cuda", dtype=torch.half)
    cu2 = torch.tensor([0, 2, 7], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(traced(x2, cu2), model(x2, cu2))


def test_eager_checks_are_unchanged():
    q = torch.randn(10, H, 8)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="must share head_dim"):
        rc.ragged_attention(q, q, torch.randn(10, H, 4), cu)
    with pytest.raises(ValueError, match="a segment of cu_seqlens_q has 5 tokens"):
        rc.ragged_attention(q, q, q, cu, max_seqlen_q=4)


# ---------------------------------------------------------------- 6: scale <= 0 on the CPU kernel


def _packed(lq, lk, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    q = torch.randn(sum(lq), hq, d, generator=g)
    k, v = (torch.randn(sum(lk), hkv, d, generator=g) for _ in range(2))
    return q, k, v, cq, ck


@pytest.mark.parametrize("scale", [-0.5, 0.0, -3.0, 1e-30])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "lq,lk", [([5, 3, 40, 0], [5, 3, 40, 2]), ([2, 3, 30], [5, 9, 50]), ([1, 2, 3, 2], [4, 4, 4, 4])]
)
def test_cpu_kernel_with_nonpositive_scale_is_finite(scale, causal, lq, lk):
    """The fused kernel masks is_causal with -inf before scaling, so scale <= 0 gave
    NaN where SDPA's math path and the oracle are finite; forward, LSE and backward."""
    from ragged_compile.backends.cpu import cpu_attention, cpu_attention_backward

    q, k, v, cq, ck = _packed(lq, lk)
    want = dense_attention(q, k, v, cq, ck, causal, scale)
    out, lse = cpu_attention(q, k, v, cq, ck, causal, scale, return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_attention(q, k, v, cq, ck, causal, scale).double(), want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(q)
    _, dq, dk, dv = dense_gradients(g, q, k, v, cq, ck, causal, scale)
    for saved in (None, (out, lse)):
        got = cpu_attention_backward(
            g, q, k, v, cq, ck, causal, scale, *(saved if saved is not None else ())
        )
        for a, b, name in zip(got, (dq, dk, dv), "qkv"):
            assert torch.isfinite(a).all(), name
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_public_op_with_nonpositive_causal_scale_matches_the_oracle(scale):
    q, k, v, cq, ck = _packed([5, 3, 40], [5, 3, 40])
    want = dense_attention(q, k, v, cq, ck, True, scale)
    torch.testing.assert_close(rc.ragged_attention(q, k, v, cq, ck, causal=True, scale=scale).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rc.reference_attention(q, k, v, cq, ck, True, scale).double(), want, atol=1e-5, rtol=1e-5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = rc.ragged_attention(*leaves, cq, ck, causal=True, scale=scale)  # the training (LSE) pair
    g = torch.randn_like(out)
    out.backward(g)
    _, dq, dk, dv = dense_gradients(g, q, k, v, cq, ck, True, scale)
    for t, want_grad in zip(leaves, (dq, dk, dv)):
        torch.testing.assert_close(t.grad.double(), want_grad, atol=1e-4, rtol=1e-4)


def test_export_records_the_inference_op_under_no_grad_and_the_training_op_with_grad():
    """What the README says of torch.export: under no_grad the exported program runs the
    inference op; with grad-requiring parameters, the training op (its fused backward
    needs the LSE)."""
    import ragged_compile as rc

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x, cu):
            h = self.proj(x).view(-1, 4, 8)
            return rc.ragged_attention(h, h, h, cu)

    x, cu = torch.randn(10, 32), torch.tensor([0, 3, 10], dtype=torch.int32)
    found = {}
    for name, ctx in (("grad", torch.enable_grad), ("no_grad", torch.no_grad)):
        with ctx():
            ep = torch.export.export(M(), (x, cu))
        found[name] = [str(n.target) for n in ep.graph.nodes if "ragged_compile" in str(n.target)]
    assert found == {
        "grad": ["ragged_compile.ragged_attention_lse.default"],
        "no_grad": ["ragged_compile.ragged_attention.default"],
    }
