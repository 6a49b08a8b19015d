"""backend="auto" against the H200 measurements it was fitted on.

bench/sweep_backends.py timed FlashInfer's fa2 and fa3 kernels side by side on
every layout class (segment lengths, causal or not, GQA group sizes, head dims)
into bench/results/sweep_backends.json. Whatever the rule in
``select.flashinfer_backend`` becomes, on each measured class it must pick a kernel
within 3% of the faster one.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from ragged_compile.backends import select

SWEEP = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results" / "sweep_backends.json"
ROWS = [r for r in json.loads(SWEEP.read_text())["rows"] if "error" not in r]


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(select, "_is_sm90", lambda index: True)


def _name(r):
    return f"{r['layout']}-{r['hq']}/{r['hkv']}-d{r['d']}-{'causal' if r['causal'] else 'full'}"


@pytest.mark.parametrize("row", ROWS, ids=_name)
def test_auto_is_within_3_percent_of_the_faster_kernel(sm90, row):
    pick = select.flashinfer_backend(
        "auto", torch.device("cuda", 0), row["n"], row["total"],
        hq=row["hq"], hkv=row["hkv"], head_dim=row["d"], causal=row["causal"],
    )
    best = min(row["fa2_ms"], row["fa3_ms"])
    assert row[f"{pick}_ms"] <= 1.03 * best, (pick, row)


def test_sweep_covers_what_the_rule_distinguishes():
    assert {r["causal"] for r in ROWS} == {False, True}
    assert {r["hq"] // r["hkv"] for r in ROWS} >= {1, 4, 8}
    assert {r["d"] for r in ROWS} >= {64, 128}
    means = sorted(r["mean"] for r in ROWS)
    assert means[0] < 32 and means[-1] > 8192


def test_explicit_backend_passes_through_and_old_gpus_get_fa2(monkeypatch):
    assert select.flashinfer_backend("fa3", torch.device("cuda", 0), 4, 32768) == "fa3"
    monkeypatch.setattr(select, "_is_sm90", lambda index: False)
    assert select.flashinfer_backend("auto", torch.device("cuda", 0), 4, 32768, hq=16, hkv=16) == "fa2"


def test_gqa_between_measured_group_sizes_is_monotone(sm90):
    # group 2 lies between groups 1 and 4 on short segments
    r1, r2, r4 = (select.predicted_fa3_over_fa2(63, 16, hkv, 128, False) for hkv in (16, 8, 4))
    assert min(r1, r4) <= r2 <= max(r1, r4)


def test_padded_layouts_are_judged_by_their_active_segments(monkeypatch):
    """A padded batch's layout carries empty segments ([pad | tokens | pad] per row):
    the kernel choice sees the segments with work on both sides and their keys only."""
    import _fake_flashinfer

    import ragged_compile as rc
    from ragged_compile.steps import HostLayout

    q_lens, k_lens = [0, 512, 0, 0, 512, 0], [100, 300, 112, 88, 400, 24]
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(torch.int32)  # noqa: E731
    lay = HostLayout(cu(q_lens), cu(k_lens))
    assert (lay.n, lay.active, lay.active_k) == (6, 2, 700)
    _fake_flashinfer.install(monkeypatch)
    from ragged_compile.backends import flash_backward

    seen, judged = [], []
    monkeypatch.setattr(select, "flashinfer_backend", lambda req, dev, n, total_k, **kw: seen.append((n, total_k)) or "fa2")
    monkeypatch.setattr(flash_backward, "unsupported_reason", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(select, "_plan_pays", lambda mean_kv, pairs, *a: judged.append((mean_kv, pairs)) or True)
    rt = rc.Runtime("cpu", backend="auto", workspace_bytes=64)
    q = torch.randn(1024, 2, 8)
    k = torch.randn(1024, 2, 8)
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    with rt.step(q_lens, k_lens) as step:
        step.attention(q, k, k, cu_q, cu_k, False, 0.3)
        step.attention(q, k, k, cu_q, cu_k, False, 0.3)  # the layout's second call: no new choice
    assert seen == [(2, 700)] and judged[0] == (350, 512 * 700)
    assert rt.stats["plans"] == 1


def test_fa3_runs_only_where_its_saving_pays_for_its_plan(sm90):
    """fa3's plan costs more host time than fa2's, once per forward: a layout whose
    calls are too small to win that back over a forward's layers runs fa2, even
    where fa3's kernel is the faster one (BERT-base on 16 rows of 256..512 tokens)."""
    dev = torch.device("cuda", 0)
    lens = [256 + 16 * i for i in range(16)]
    small = dict(hq=12, hkv=12, head_dim=64, causal=False)
    n, total = len(lens), sum(lens)
    assert select.predicted_fa3_over_fa2(total / n, 12, 12, 64, False) < select._FA3_MARGIN  # fa3's kernel wins
    assert select.flashinfer_backend("auto", dev, n, total, **small) == "fa3"  # judged on the kernel alone
    assert select.flashinfer_backend("auto", dev, n, total, pairs=sum(x * x for x in lens), **small) == "fa2"
    # a long layout's calls win the plan back many times over
    big = [4096] * 8
    assert select.flashinfer_backend("auto", dev, 8, sum(big), pairs=sum(x * x for x in big), **small) == "fa3"
    # and a layout fa3 loses on stays on fa2 whatever its size
    tiny = [17] * 2000
    assert select.flashinfer_backend("auto", dev, 2000, sum(tiny), pairs=sum(x * x for x in tiny), **small) == "fa2"


# -- no plan at all: PyTorch's FlashAttention-2 where FlashInfer's plan does not pay -----


@pytest.fixture
def varlen_runs(monkeypatch, sm90):
    from ragged_compile.backends import flash_backward

    monkeypatch.setattr(flash_backward, "unsupported_reason", lambda device, dtype, head_dim: None)


def _padded(batch, length, real=0.75, seed=0):
    """A right-padded batch's layout as the transformers path builds it."""
    import numpy as np

    from ragged_compile.hf import _layout_of_runs
    from ragged_compile.steps import HostLayout

    rng = np.random.default_rng(seed)
    n = rng.integers(int(length * (2 * real - 1)), length + 1, batch)
    seg = _layout_of_runs(np.zeros(batch, dtype=np.int64), n.astype(np.int64), length, length, False)
    return HostLayout(seg.cu_q, seg.cu_k)


def _packed(lens):
    from ragged_compile.steps import HostLayout

    return HostLayout.from_lengths(lens)


def _kernel(layout, requested="auto", hq=12, hkv=12, d=64, causal=False, dtype=torch.bfloat16):
    return select.cuda_backend(
        requested, torch.device("cuda", 0), dtype, layout.n, layout.active, layout.active_k, layout.pairs,
        hq=hq, hkv=hkv, head_dim=d, causal=causal, max_q=layout.max_lens[0], total_q=layout.total_q,
    )


@pytest.mark.parametrize("batch,length", [(64, 48), (64, 128), (16, 512), (256, 128)])
def test_small_padded_batches_run_varlen_without_a_plan(varlen_runs, batch, length):
    """BERT-base's padded batches of the sizes embedding servers send: their whole
    forward's attention is less work than FlashInfer's plan costs the host."""
    assert _kernel(_padded(batch, length)) == "varlen"
    assert _kernel(_padded(batch, length), causal=True) == "varlen"


def test_attention_heavy_layouts_plan_flashinfer(varlen_runs):
    mixed = _packed([1883, 3842, 1501, 2104, 602, 3402, 64, 2591, 221, 2127, 2969, 4096, 2431, 2098, 3811, 301])
    big = dict(hq=16, hkv=16, d=128)
    assert _kernel(mixed, **big) == "fa3"
    assert _kernel(mixed, causal=True, **big) == "fa3"
    assert _kernel(_packed([8192] * 4), **big) == "fa3"
    assert _kernel(_packed([16 + (i * 97) % 240 for i in range(250)]), **big) == "fa2"  # short flood, 33k tokens
    assert _kernel(_padded(64, 512), hq=16, d=128) in ("fa2", "fa3")
    # the saving grows with the work: a layout that plans stays planned when it grows
    assert _kernel(_padded(64, 512, seed=1), hq=16, d=128) != "varlen"


def test_requested_backends_and_what_varlen_cannot_run(varlen_runs, monkeypatch):
    from ragged_compile.backends import flash_backward

    small = _padded(64, 48)
    assert _kernel(small, "fa2") == "fa2" and _kernel(small, "fa3") == "fa3"
    assert _kernel(_packed([8192] * 4), "varlen", hq=16, d=128) == "varlen"
    # past FlashAttention-2's grid limit of segments: FlashInfer, forced or not
    flood = _packed([1] * (flash_backward.MAX_SEGMENTS + 1))
    assert _kernel(flood) != "varlen" and _kernel(flood, "varlen") != "varlen"
    # one-query segments with GQA: FlashAttention-2's forward folds the group's heads
    # into rows and fails on empty segments there (found on the H200)
    decode = _packed([1] * 28 + [0] * 12)
    assert _kernel(decode, hq=8, hkv=1) != "varlen" and _kernel(decode, "varlen", hq=8, hkv=1) != "varlen"
    assert _kernel(decode, hq=8, hkv=8) == "varlen"
    assert _kernel(_packed([1] * 40), hq=8, hkv=1) == "varlen"  # one query in every segment: it folds right
    # where FlashAttention-2 does not run (an old GPU, another dtype): FlashInfer
    monkeypatch.setattr(flash_backward, "unsupported_reason", lambda device, dtype, head_dim: "no")
    assert _kernel(small) == "fa3" or _kernel(small) == "fa2"
    assert _kernel(small, "varlen") in ("fa2", "fa3")


def test_small_padded_encoder_batches_go_to_sdpa_and_the_rest_stay_ragged():
    """select.padded_kernel: BERT-base batches of the sizes embedding servers send
    (host-bound forwards) take SDPA with their mask; larger ones, and every causal
    call, the op."""
    for b, s in ((64, 48), (64, 128), (16, 512), (256, 128)):
        assert select.padded_kernel(b, s, s, 12, 64, False) == "sdpa", (b, s)
        assert select.padded_kernel(b, s, s, 12, 64, True) == "ragged", (b, s)
    for b, s, h in ((64, 512, 12), (64, 512, 16), (128, 256, 16), (32, 512, 16)):
        assert select.padded_kernel(b, s, s, h, 64, False) == "ragged", (b, s, h)
    # cross-attention counts its keys
    assert select.padded_kernel(64, 48, 48 * 64, 12, 64, False) == "ragged"


def test_a_varlen_runtime_that_must_plan_gets_flashinfers_auto_family(sm90):
    """Graph mode, variants and layouts FlashAttention-2 cannot take plan FlashInfer:
    a runtime asking for ``"varlen"`` then gets what ``"auto"`` picks."""
    dev = torch.device("cuda", 0)
    for n, total in ((4, 32768), (2000, 2000 * 17)):
        assert select.flashinfer_backend("varlen", dev, n, total, hq=16, hkv=16) == select.flashinfer_backend(
            "auto", dev, n, total, hq=16, hkv=16
        )


# -- the training backward: flash-attn-4 against FlashAttention-2 ---------------------------
# bench/bench_train.py --only bwd-sweep timed forward+backward with each backward forced
# (FA4's isolation layout by the fused gather) on every layout class, causal or not, GQA,
# head dims 64/80/128/256, into bench/results/train-bwd-sweep.json.

BWD_SWEEP = SWEEP.parent / "train-bwd-sweep.json"
BWD_ROWS = [r for r in json.loads(BWD_SWEEP.read_text())["bwd_sweep"] if "fa2_ms" in r and "fa4_fused_ms" in r]


def _bwd_name(r):
    return f"{r['kind']}-{r['hq']}/{r['hkv']}-d{r['d']}-{'causal' if r['causal'] else 'full'}"


@pytest.mark.parametrize("row", BWD_ROWS, ids=_bwd_name)
def test_auto_backward_is_within_6_percent_of_the_faster_kernel(row, monkeypatch):
    """6%, not 3%: FA4 only where the sweep has it >= 8% faster (see select.py: after
    FlashInfer's forward it measured slower on a row the sweep had 5% in its favour)."""
    from ragged_compile.backends import fa4_backward

    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    monkeypatch.setenv("RAGGED_COMPILE_FA4_PAD", "fused")  # the isolation these columns timed
    monkeypatch.setattr(fa4_backward, "unsupported_reason", lambda *a: None)  # installed, SM90
    work = select.backward_work(row["hq"], row["hkv"], row["tokens"], row["tokens"], row["pairs"], row["causal"])
    slots = (row["segments"], row["tokens"], row["tokens"])
    pick = select.backward_kernel(torch.device("cuda", 0), torch.bfloat16, row["d"], work, slots=slots)
    ms = {"fa2": row["fa2_ms"], "fa4": row["fa4_fused_ms"]}
    assert ms[pick] <= 1.06 * min(ms.values()), (pick, work, row)
    if ms["fa4"] <= 0.92 * ms["fa2"] or ms["fa2"] <= ms["fa4"]:  # clear wins are taken
        assert ms[pick] == min(ms.values()), (pick, work, row)


# The same sweep with isolation by recompute (the default at head dims 64/96/128/256),
# FA4's column timed with it: bench/results/train-bwd-sweep-redo.json.
REDO_ROWS = [
    r for r in json.loads((SWEEP.parent / "train-bwd-sweep-redo.json").read_text())["bwd_sweep"]
    if "fa2_ms" in r and "fa4_redo_ms" in r
]


@pytest.mark.parametrize("row", REDO_ROWS, ids=_bwd_name)
def test_auto_backward_with_isolation_by_recompute_is_within_3_percent_of_the_faster_kernel(row, monkeypatch):
    from ragged_compile.backends import fa4_backward

    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    monkeypatch.delenv("RAGGED_COMPILE_FA4_PAD", raising=False)
    monkeypatch.setattr(fa4_backward, "unsupported_reason", lambda *a: None)  # installed, SM90
    assert fa4_backward.redo_isolation(row["d"])
    work = select.backward_work(row["hq"], row["hkv"], row["tokens"], row["tokens"], row["pairs"], row["causal"])
    slots = (row["segments"], row["tokens"], row["tokens"])
    pick = select.backward_kernel(torch.device("cuda", 0), torch.bfloat16, row["d"], work, slots=slots)
    ms = {"fa2": row["fa2_ms"], "fa4": row["fa4_redo_ms"]}
    assert ms[pick] <= 1.03 * min(ms.values()), (pick, work, row)


def test_the_recompute_sweep_has_rows_the_rule_sends_either_way():
    assert {r["d"] for r in REDO_ROWS} >= {64, 128, 256} and {r["causal"] for r in REDO_ROWS} == {False, True}
    for d in {r["d"] for r in REDO_ROWS}:
        ratios = [r["fa4_redo_ms"] / r["fa2_ms"] for r in REDO_ROWS if r["d"] == d]
        assert min(ratios) < 0.97 and max(ratios) > 1.03, d


def test_backward_sweep_covers_what_the_rule_distinguishes():
    assert {r["causal"] for r in BWD_ROWS} == {False, True}
    assert {r["d"] for r in BWD_ROWS} >= {64, 80, 128, 256}
    assert {r["hq"] // r["hkv"] for r in BWD_ROWS} >= {1, 4}
    assert {r["kind"] for r in BWD_ROWS} >= {"short", "vit", "mid", "mixed", "long"}
    # each head dim has rows the rule sends either way
    for d in {r["d"] for r in BWD_ROWS}:
        ratios = [r["fa4_fused_ms"] / r["fa2_ms"] for r in BWD_ROWS if r["d"] == d]
        assert min(ratios) < 0.97 and max(ratios) > 1.03, d


def test_full_rows_run_dense_sdpa_only_where_it_is_the_same_attention():
    """select.full_rows_kernel: a padding mask that pads nothing goes to SDPA without
    the mask (stock's kernel for it), except where SDPA without a mask would differ
    from the op: GQA (SDPA would need enable_gqa), causal with more keys than queries
    (SDPA aligns top-left, the op bottom-right)."""
    assert select.full_rows_kernel(12, 12, 512, 512, False) == "sdpa"
    assert select.full_rows_kernel(12, 12, 512, 512, True) == "sdpa"
    assert select.full_rows_kernel(12, 12, 7, 512, False) == "sdpa"  # cross-attention, no mask needed
    assert select.full_rows_kernel(12, 12, 7, 512, True) == "ragged"
    assert select.full_rows_kernel(32, 8, 512, 512, False) == "ragged"


# flash-attn-4's training forward against FlashInfer's, isolation included:
# bench/results/train-fwd-sweep.json (the forward alone).
FWD_ROWS = [r for r in json.loads((SWEEP.parent / "train-fwd-sweep.json").read_text())["fwd_sweep"] if "fa4_fwd_ms" in r]
# 4 x 8192, GQA 32/8 x 128, causal: FA4 5% faster in that call, where its non-causal twin
# (twice the work) had it 5% slower; no rule monotone in the work takes one and not the
# other, so the rule leaves head dim 128 to FlashInfer (within 6% there)
_NOT_FITTED = {("long", 32, 8, 128, True)}


def _auto_forward(row, monkeypatch) -> str:
    from ragged_compile.backends import fa4_backward, fa4_forward

    monkeypatch.delenv("RAGGED_COMPILE_BACKWARD", raising=False)
    monkeypatch.delenv("RAGGED_COMPILE_FA4_PAD", raising=False)
    monkeypatch.setattr(fa4_backward, "unsupported_reason", lambda *a: None)  # installed, SM90
    monkeypatch.setattr(fa4_forward, "unsupported_reason", lambda *a: None)
    slots = (row["segments"], row["tokens"], row["tokens"])
    got = select.training_forward("auto", torch.device("cuda", 0), torch.bfloat16, row["d"], row["hq"], row["hkv"],
                                  row["pairs"], row["causal"], slots)
    return got or "fi"


@pytest.mark.parametrize("row", FWD_ROWS, ids=_bwd_name)
def test_auto_training_forward_is_within_3_percent_of_the_faster_kernel(row, monkeypatch):
    pick = _auto_forward(row, monkeypatch)
    ms = {"fi": row["fi_fwd_ms"], "fa4": row["fa4_fwd_ms"]}
    key = (row["kind"], row["hq"], row["hkv"], row["d"], row["causal"])
    assert ms[pick] <= (1.06 if key in _NOT_FITTED else 1.03) * min(ms.values()), (pick, row)


def test_the_forward_sweep_has_rows_the_rule_sends_either_way(monkeypatch):
    assert {r["kind"] for r in FWD_ROWS} >= {"short", "vit", "mid", "mixed", "long"}
    assert {r["d"] for r in FWD_ROWS} >= {64, 128, 256} and {r["causal"] for r in FWD_ROWS} == {False, True}
    assert {_auto_forward(r, monkeypatch) for r in FWD_ROWS} == {"fa4", "fi"}
