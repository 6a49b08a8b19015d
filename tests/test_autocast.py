"""The ops under torch.autocast, as SDPA: q, k and v are cast to autocast's dtype.

Mixed inputs are what RoPE with fp32 buffers gives (a bf16 q with fp32 k/v), and
fp32 activations under autocast are what a model without casts of its own gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged_compile as rc
from ragged_compile.reference import dense_attention

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(device, dtypes=(torch.bfloat16, torch.float32, torch.float32)):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(13, 4, 32, generator=g).to(device, dtypes[0])
    k = torch.randn(13, 2, 32, generator=g).to(device, dtypes[1])
    v = torch.randn(13, 2, 32, generator=g).to(device, dtypes[2])
    cu = torch.tensor([0, 4, 4, 13], dtype=torch.int32, device=device)
    return q, k, v, cu


def _params(devices):
    return [pytest.param(d, marks=[pytest.mark.cuda] if d == "cuda" else []) for d in devices]


@pytest.mark.parametrize("device", _params(DEVICES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mixed", [True, False])
def test_public_op_takes_autocast_dtype(device, dtype, mixed):
    q, k, v, cu = _inputs(device, (torch.bfloat16, torch.float32, torch.float32) if mixed else (torch.float32,) * 3)
    want = dense_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu, cu, True, 32**-0.5)
    with torch.autocast(device, dtype):
        out = rc.ragged_attention(q, k, v, cu, causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)
    # outside autocast mixed dtypes stay an error that says what to do
    if mixed:
        with pytest.raises(TypeError, match="share one dtype"):
            rc.ragged_attention(q, k, v, cu)


@pytest.mark.parametrize("device", _params(DEVICES))
def test_ops_themselves_and_compiled_code_cast(device):
    q, k, v, cu = _inputs(device)
    with torch.autocast(device, torch.bfloat16):
        out = torch.ops.ragged_compile.ragged_attention(q, k, v, cu, cu, False, 0.2)
        compiled = torch.compile(lambda q, k, v: rc.ragged_attention(q, k, v, cu, scale=0.2), fullgraph=True)
        out_c = compiled(q, k, v)
    assert out.dtype == out_c.dtype == torch.bfloat16
    want = dense_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, cu, False, 0.2)
    for o in (out, out_c):
        torch.testing.assert_close(o.double().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", _params(DEVICES))
def test_training_under_autocast_gives_fp32_gradients(device):
    q, k, v, cu = _inputs(device, (torch.float32,) * 3)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with torch.autocast(device, torch.bfloat16):
        out = rc.ragged_attention(q, k, v, cu, causal=True)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in (q, k, v))


@pytest.mark.parametrize("device", _params(DEVICES))
def test_njt_sdpa_under_autocast_runs_our_op(device, monkeypatch):
    from ragged_compile import ops

    calls = []
    real = ops.attention
    monkeypatch.setattr("ragged_compile.njt.attention", lambda *a, **kw: calls.append(a[0].dtype) or real(*a, **kw))
    g = torch.Generator().manual_seed(1)
    x = torch.nested.nested_tensor(
        [torch.randn(n, 4 * 32, generator=g).to(device) for n in (3, 9, 1)], layout=torch.jagged
    )
    h = x.unflatten(-1, (4, 32)).transpose(1, 2)
    with rc.enable(), torch.autocast(device, torch.bfloat16):
        out = F.scaled_dot_product_attention(h, h.float(), h)
    assert calls == [torch.bfloat16] and out.dtype == torch.bfloat16
    for i, seg in enumerate(x.unbind()):
        hs = seg.view(-1, 4, 32).bfloat16()
        cu = torch.tensor([0, hs.shape[0]], dtype=torch.int32)
        want = dense_attention(hs, hs, hs, cu, cu, False, 32**-0.5)
        torch.testing.assert_close(out.transpose(1, 2).unbind()[i].double().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", _params(DEVICES))
def test_transformers_attention_decides_on_the_autocast_dtype(device, monkeypatch):
    """A float32 decoder under bf16 autocast: RoPE hands the attention function
    float32 q and k. The support check sees what the kernel will get (bf16, as
    SDPA casts), so a kernel that takes only half precision (FlashInfer on CUDA;
    here forced on CPU too) still runs our op."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ragged_compile import hf
    from tests._hf_common import OURS, Count, pad_mask

    real = hf.unsupported_reason

    def half_only(dev, dtype, head_dim, **kw):
        return "half precision only" if dtype == torch.float32 else real(dev, dtype, head_dim, **kw)

    monkeypatch.setattr(hf, "unsupported_reason", half_only)
    seen = []

    class Dtypes(Count):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in OURS:
                seen.append(args[0].dtype)
            return super().__torch_dispatch__(func, types, args, kwargs)

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(cfg).to(device).eval()
    ref.set_attn_implementation("sdpa")
    model = Qwen2ForCausalLM(cfg).to(device).eval()
    model.load_state_dict(ref.state_dict())
    model.set_attn_implementation(hf.register())
    ids = torch.randint(1, 63, (3, 12), device=device)
    mask = pad_mask([12, 5, 9], 12).to(device)
    with torch.no_grad(), torch.autocast(device, torch.bfloat16):
        want = ref(input_ids=ids, attention_mask=mask).logits
        with Dtypes() as count:
            got = model(input_ids=ids, attention_mask=mask).logits
    assert count.n == 2 and set(seen) == {torch.bfloat16}
    valid = mask.bool()
    torch.testing.assert_close(got[valid].float(), want[valid].float(), atol=3e-2, rtol=3e-2)
