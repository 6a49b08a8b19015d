"""Errors a user can act on: each names the argument or call at fault and the fix.

Also what the op supports that used to fail: torch.func transforms (eager) and a
CPU ``Runtime``.
"""

from __future__ import annotations

import pytest
import torch

import ragged_compile as rc
from ragged_compile.reference import dense_attention


def _inputs(lq, lk=None, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    lk = lq if lk is None else lk
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    return q, k, v, torch.tensor([0] + lq).cumsum(0), torch.tensor([0] + lk).cumsum(0)


# -- autograd ---------------------------------------------------------------------


def test_double_backward_names_create_graph_and_the_way_out():
    q, k, v, cq, ck = _inputs([3, 0, 4])
    q.requires_grad_()
    (g,) = torch.autograd.grad(rc.ragged_attention(q, k, v, cq, ck).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"no double backward.*create_graph=False"):
        g.sum().backward()


def test_second_order_torch_func_says_what_is_missing():
    q, k, v, cq, ck = _inputs([3, 2])
    f = lambda q: rc.ragged_attention(q, k, v, cq, ck).square().sum()  # noqa: E731
    with pytest.raises(RuntimeError, match=r"no double backward.*first-order"):
        torch.func.jacrev(torch.func.grad(f))(q)
    with pytest.raises(RuntimeError, match=r"no forward-mode AD.*hessian.*use reverse mode"):
        torch.func.hessian(f)(q)
    with pytest.raises(RuntimeError, match=r"no forward-mode AD.*jvp"):
        torch.func.jvp(lambda q: rc.ragged_attention(q, k, v, cq, ck), (q,), (torch.ones_like(q),))


@pytest.mark.parametrize("causal", [False, True])
def test_torch_func_grad_and_jacrev_match_autograd(causal):
    q, k, v, cq, ck = _inputs([3, 0, 1, 4], [2, 5, 0, 4])
    w = torch.randn(q.shape, dtype=q.dtype)
    f = lambda q, k, v: (rc.ragged_attention(q, k, v, cq, ck, causal=causal) * w).sum()  # noqa: E731
    grads = torch.func.grad(f, argnums=(0, 1, 2))(q, k, v)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    f(qa, ka, va).backward()
    for got, want in zip(grads, (qa.grad, ka.grad, va.grad)):
        torch.testing.assert_close(got, want)
    # jacrev runs the backward under vmap: one call per cotangent.
    jac = torch.func.jacrev(lambda q: rc.ragged_attention(q, k, v, cq, ck, causal=causal)[:3])(q)
    want = torch.autograd.functional.jacobian(
        lambda q: dense_attention(q, k, v, cq, ck, causal, 8**-0.5)[:3], q
    )
    torch.testing.assert_close(jac, want)


def test_functional_call_gradients_of_a_module():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48, dtype=torch.float64)

        def forward(self, x, cu):
            q, k, v = self.qkv(x).unflatten(-1, (6, 8)).chunk(3, dim=1)
            return rc.ragged_attention(q, k, v, cu, causal=True)

    torch.manual_seed(0)
    model = Attn()
    x = torch.randn(9, 16, dtype=torch.float64)
    cu = torch.tensor([0, 4, 4, 9])
    params = dict(model.named_parameters())
    loss = lambda p: torch.func.functional_call(model, p, (x, cu)).square().sum()  # noqa: E731
    grads = torch.func.grad(loss)(params)
    model(x, cu).square().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def test_vmap_runs_each_element_with_its_own_layout():
    q, k, v, _, _ = _inputs([3, 3])
    cus = torch.tensor([[0, 3, 6], [0, 1, 6], [0, 6, 6]])
    out = torch.func.vmap(lambda cu: rc.ragged_attention(q, k, v, cu, causal=True))(cus)
    for cu, got in zip(cus, out):
        torch.testing.assert_close(got, rc.ragged_attention(q, k, v, cu, causal=True))
    assert not torch.equal(out[0], out[1])


def _compiled_transforms(q, k, v, cq, ck):
    f = lambda q, k, v: rc.ragged_attention(q, k, v, cq, ck, causal=True)  # noqa: E731
    total = lambda q, k, v: f(q, k, v).square().sum()  # noqa: E731
    qs, ks, vs = (torch.stack([t, t.flip(0)]) for t in (q, k, v))
    return {
        "grad": (torch.func.grad(total, argnums=(0, 1, 2)), (q, k, v)),
        "vjp": (lambda q: torch.func.vjp(lambda q: f(q, k, v), q)[1](q.cos())[0], (q,)),
        "jacrev": (torch.func.jacrev(lambda q: f(q, k, v)[:2]), (q,)),
        "vmap(grad)": (torch.func.vmap(torch.func.grad(total)), (qs, ks, vs)),
        "grad(vmap)": (torch.func.grad(lambda q: torch.func.vmap(f)(q, ks, vs).square().sum()), (qs,)),
    }


@pytest.mark.parametrize("name", ["grad", "vjp", "jacrev", "vmap(grad)", "grad(vmap)"])
def test_compiled_torch_func_gradients_run_eagerly_or_say_what_to_call(name):
    """Dynamo differentiates an autograd.Function's forward under torch.func
    and ignores its backward; the op's forward is a fused kernel, so a compiled
    gradient transform runs the frame eagerly (exact), and fullgraph=True
    names the ways that compile."""
    q, k, v, cq, ck = _inputs([3, 0, 4], [2, 1, 4])
    fn, args = _compiled_transforms(q, k, v, cq, ck)[name]
    want = fn(*args)
    torch._dynamo.reset()
    got = torch.compile(fn)(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"torch.func.grad\(f\) eagerly.*torch.autograd.grad"):
        torch.compile(fn, fullgraph=True)(*args)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_vmap_runs_the_op_per_element(fullgraph):
    q, k, v, _, _ = _inputs([3, 3])
    cus = torch.tensor([[0, 3, 6], [0, 1, 6], [0, 6, 6]])
    fn = torch.func.vmap(lambda cu: rc.ragged_attention(q, k, v, cu, causal=True))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, fullgraph=fullgraph)(cus), fn(cus), rtol=0, atol=0)


# -- inputs -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_names_the_dtype_and_the_cast(dtype):
    q, k, v, cq, ck = _inputs([3, 2])
    with pytest.raises(TypeError, match=r"q has dtype torch\.float8.*\.to\(torch\.bfloat16\)"):
        rc.ragged_attention(q.to(dtype), k.to(dtype), v.to(dtype), cq, ck)


def test_zero_query_heads_names_q_and_the_reshape():
    q, k, v, cq, ck = _inputs([3, 2])
    with pytest.raises(ValueError, match=r"q has 0 heads.*heads >= 1"):
        rc.ragged_attention(q[:, :0], k, v, cq, ck)
    with pytest.raises(ValueError, match=r"positive multiple of k/v heads \(0\)"):
        rc.ragged_attention(q, k[:, :0], v[:, :0], cq, ck)


def test_zero_heads_under_compile_is_a_clear_error_not_zero_division():
    q, k, v, cq, ck = _inputs([3, 2], dtype=torch.float32)
    op = torch.ops.ragged_compile.ragged_attention
    f = torch.compile(lambda q, k, v: op(q, k, v, cq, ck, False, 0.3), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"heads \(0\) must be >= 1") as info:
        f(q, k[:, :0], v[:, :0])
    assert not isinstance(info.value, ZeroDivisionError)


# -- TorchScript ------------------------------------------------------------------


def test_torchscript_names_the_op_to_call_instead():
    with pytest.raises(RuntimeError, match=r"TorchScript.*torch\.ops\.ragged_compile\.ragged_attention\("):
        torch.jit.script(rc.ragged_attention)

    class M(torch.nn.Module):
        def forward(self, q, k, v, cu):
            return rc.ragged_attention(q, k, v, cu)

    with pytest.raises(RuntimeError, match=r"torch\.ops\.ragged_compile\.ragged_attention\("):
        torch.jit.script(M())


def test_the_torchscript_fix_in_the_message_works():
    @torch.jit.script
    def scripted(q, k, v, cu: torch.Tensor):
        return torch.ops.ragged_compile.ragged_attention(q, k, v, cu, cu, True, 0.25)

    q, k, v, cq, _ = _inputs([3, 4], hkv=4, dtype=torch.float32)
    torch.testing.assert_close(scripted(q, k, v, cq), rc.ragged_attention(q, k, v, cq, causal=True, scale=0.25))


# -- Runtime on a CPU-only build ----------------------------------------------------


def test_runtime_without_cuda_is_a_cpu_runtime_that_runs_the_cpu_kernel():
    if torch.cuda.is_available():
        rt = rc.Runtime("cpu")
    else:
        rt = rc.Runtime()
    assert rt.device == torch.device("cpu")
    for dtype, kernel in ((torch.float32, "cpu"), (torch.float64, "reference")):
        q, k, v, cq, ck = _inputs([3, 0, 4], [2, 2, 1], dtype=dtype)
        with rt.step([3, 0, 4], [2, 2, 1]):
            out = rt.attention(q, k, v, cq, ck, True, 0.3)
        torch.testing.assert_close(out, rc.ragged_attention(q, k, v, cq, ck, causal=True, scale=0.3))
        assert rt.last_backend == kernel
    assert rt.stats["cpu"] == 1 and rt.stats["reference"] == 1 and rt.stats["plans"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_cuda_runtime_without_cuda_names_the_device_and_the_fix():
    with pytest.raises(RuntimeError, match=r"Runtime\(device='cuda'\).*is_available\(\) is False.*Runtime\('cpu'\)"):
        rc.Runtime("cuda")


def test_runtime_on_another_device_type_says_none_is_needed():
    with pytest.raises(ValueError, match=r"Runtime\(device='meta'\).*needs no runtime"):
        rc.Runtime("meta")


def test_float8_under_compile_names_the_cast():
    q, k, v, cq, ck = _inputs([3, 2], dtype=torch.float32)
    f8 = torch.float8_e4m3fn
    op = torch.ops.ragged_compile.ragged_attention
    f = torch.compile(lambda q, k, v: op(q, k, v, cq, ck, False, 0.3), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"float8_e4m3fn.*\.to\(torch\.bfloat16\)"):
        f(q.to(f8), k.to(f8), v.to(f8))
