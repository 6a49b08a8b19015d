"""Reporting: run metadata, the markdown tables (attention.md) of
bench_attention.py's results, and one-line log records."""

from __future__ import annotations

import datetime
import sys

from env import environment
from variants import IMPL_NAMES


def fmt_rec(name, rec) -> str:
    st = rec.get("status")
    if st == "ok":
        s = f"{name:18s} {rec['ms']:9.3f} ms"
        if rec.get("tflops") is not None:
            s += f"  {rec['tflops']:7.1f} TFLOP/s"
        d = rec.get("max_diff_vs_reference", rec.get("max_diff_vs_ours"))
        if d is not None:
            s += f"  maxdiff {d:.2e}"
        for k in ("plan_ms", "block_mask_ms"):
            if rec.get(k) is not None:
                s += f"  {k} {rec[k]:.3f}"
        if rec.get("correct") is False:
            s += "  WRONG"
        return s + f"  (setup {rec.get('setup_s', 0):.1f}s)"
    return f"{name:18s} {st}: {_one_line(rec.get('reason') or rec.get('error'), 400)}"


def summarize_layout(impls: dict) -> dict:
    def ms(n):
        r = impls.get(n) or {}
        return r.get("ms") if r.get("status") == "ok" else None

    s: dict = {}
    ours = ms("ours_eager")
    backend = (impls.get("ours_eager") or {}).get("backend_used")
    s["ours_backend"] = backend
    fi = {b: ms(f"flashinfer_{b}") for b in ("fa2", "fa3")}
    if ours:
        if backend in fi and fi[backend]:
            s["ours_vs_flashinfer"] = ours / fi[backend]
        best = [x for x in fi.values() if x]
        if best:
            s["ours_vs_flashinfer_best"] = ours / min(best)
        vs = {}
        for n in IMPL_NAMES:
            if n != "ours_eager" and ms(n):
                vs[n] = ms(n) / ours
        s["speedup_vs"] = vs  # other ms / ours_eager ms: > 1 means ours is faster
        if ms("varlen_attn"):
            s["speedup_vs_varlen"] = ms("varlen_attn") / ours
    oc = ms("ours_compiled")
    if oc and backend in fi and fi[backend]:
        s["ours_compiled_vs_flashinfer"] = oc / fi[backend]
    return s




def section_meta(args, dev) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(dev),
        "smoke": bool(args.smoke),
        "argv": sys.argv[1:],
        **environment(),
    }


def _one_line(msg: str, limit: int = 300) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def _cell(rec: dict | None, notes: dict) -> str:
    """A table cell; errors/skips become a numbered note shared by equal messages."""
    if not rec:
        return ""
    st = rec.get("status")
    if st == "ok":
        s = f"{rec['ms']:.3f}"
        if rec.get("tflops") is not None:
            s += f" ({rec['tflops']:.3g})"
        if rec.get("correct") is False:
            s += " **WRONG**"
        return s
    msg = _one_line(f"{rec.get('impl')}: {rec.get('reason') or rec.get('error') or ''}").replace("|", "\\|")
    num = notes.setdefault(msg, len(notes) + 1)
    return f"{st} [{num}]"


def _f(x, fmt="{:.3f}"):
    return "" if x is None else (fmt.format(x) if isinstance(x, (int, float)) else str(x))


def render_markdown(results: dict) -> str:
    L = ["# Ragged attention benchmark", ""]
    ops, e2e = results.get("ops"), results.get("e2e")
    meta = (ops or e2e or {}).get("meta", {})
    if meta:
        L.append(
            f"GPU: {meta.get('gpu') or meta.get('device')} | torch {meta.get('torch')} | "
            f"flashinfer {meta.get('flashinfer')} | triton {meta.get('triton')} | {meta.get('date')}"
            + (" | **SMOKE (tiny sizes)**" if meta.get("smoke") else "")
        )
        L.append("")
    if ops and ops.get("layouts"):
        lay = ops["layouts"]
        names = list(lay)
        notes: dict = {}
        L += ["## Per op: median ms per call (useful TFLOP/s)", ""]
        L.append("| impl | " + " | ".join(names) + " |")
        L.append("|---" * (len(names) + 1) + "|")
        for impl in IMPL_NAMES:
            if not any(impl in lay[n].get("impls", {}) for n in names):
                continue
            L.append(f"| {impl} | " + " | ".join(_cell(lay[n]["impls"].get(impl), notes) for n in names) + " |")
        L.append("")
        L += ["Layouts:", ""]
        for n in names:
            d = lay[n].get("layout", {})
            L.append(
                f"- `{n}`: {d.get('segments')} segments, {d.get('tokens')} tokens "
                f"(lengths {d.get('min_len')}..{d.get('max_len')}), H {d.get('hq')}/{d.get('hkv')}, "
                f"D {d.get('head_dim')}, causal {d.get('causal')}, {_f(d.get('useful_flops', 0) / 1e12, '{:.2f}')} useful TFLOP"
            )
        L.append("")
        L += ["## Ratios and host costs", ""]
        L.append(
            "| layout | ours backend | ours / flashinfer (same backend) | ours / best flashinfer | "
            "ours / flashinfer paired | ours_compiled / flashinfer | varlen / ours | plan ms ours | plan ms fi fa2 | "
            "plan ms fi fa3 | flex block mask ms |"
        )
        L.append("|---" * 11 + "|")
        for n in names:
            s, im = lay[n].get("summary", {}), lay[n].get("impls", {})
            L.append(
                f"| {n} | {_f(s.get('ours_backend'))} | {_f(s.get('ours_vs_flashinfer'))} | "
                f"{_f(s.get('ours_vs_flashinfer_best'))} | {_f((s.get('paired_ours_vs_flashinfer') or {}).get('ratio'))} | "
                f"{_f(s.get('ours_compiled_vs_flashinfer'))} | "
                f"{_f(s.get('speedup_vs_varlen'))} | {_f(im.get('ours_eager', {}).get('plan_ms'))} | "
                f"{_f(im.get('flashinfer_fa2', {}).get('plan_ms'))} | {_f(im.get('flashinfer_fa3', {}).get('plan_ms'))} | "
                f"{_f(im.get('flex_doc_mask', {}).get('block_mask_ms'))} |"
            )
        L.append("")
        paired = {n: lay[n].get("summary", {}).get("paired_ours_vs_flashinfer") or {} for n in names}
        if any("ratio_vs_best" in p for p in paired.values()):
            L += [
                '## backend="auto" against the faster FlashInfer kernel (paired blocks)',
                "",
                "ours_eager (backend auto) and FlashInfer fa2 / fa3 run directly, median ms of rotating "
                "blocks; target: ours / best <= 1.03 on every layout.",
                "",
                "| layout | causal | H q/kv | ours picked | ours ms | fa2 ms | fa3 ms | best | ours / fa2 | "
                "ours / fa3 | ours / best | within 3% | plan ms ours |",
            ]
            L.append("|---" * 13 + "|")
            for n in names:
                p, d = paired[n], lay[n].get("layout", {})
                if "ratio_vs_best" not in p:
                    if p.get("error"):
                        L.append(f"| {n} | error: {_one_line(p['error'], 150)} |")
                    continue
                L.append(
                    f"| {n} | {d.get('causal')} | {d.get('hq')}/{d.get('hkv')} | {_f(p.get('backend'))} | "
                    f"{_f(p.get('ours_ms'))} | {_f(p.get('fa2_ms'))} | {_f(p.get('fa3_ms'))} | {_f(p.get('best'))} | "
                    f"{_f(p.get('ratio_vs_fa2'))} | {_f(p.get('ratio_vs_fa3'))} | {_f(p.get('ratio_vs_best'))} | "
                    f"{'yes' if p.get('within_3pct') else '**no**'} | "
                    f"{_f(lay[n].get('impls', {}).get('ours_eager', {}).get('plan_ms'))} |"
                )
            L.append("")
        L += ["## Correctness: max abs diff vs float32 reference (vs ours_eager)", ""]
        L.append("| impl | " + " | ".join(names) + " |")
        L.append("|---" * (len(names) + 1) + "|")
        for impl in IMPL_NAMES:
            cells = []
            for n in names:
                r = lay[n].get("impls", {}).get(impl) or {}
                a, b = r.get("max_diff_vs_reference"), r.get("max_diff_vs_ours")
                c = "" if a is None else f"{a:.1e}"
                if b is not None:
                    c += f" ({b:.1e})"
                if r.get("correct") is False:
                    c += " **WRONG**"
                cells.append(c)
            if any(cells):
                L.append(f"| {impl} | " + " | ".join(cells) + " |")
        L.append("")
        if notes:
            L += ["Notes (errors, skips, unsupported):", ""]
            L += [f"{num}. {m}" for m, num in notes.items()]
            L.append("")
    if e2e and e2e.get("variants"):
        cfg = e2e.get("config", {})
        L += [
            "## End to end: encoder forward",
            "",
            f"{cfg.get('layers')} layers, d_model {cfg.get('d_model')}, {cfg.get('heads')} heads, MLP x4 GELU, "
            f"pre-norm LayerNorm, {cfg.get('dtype')}, {cfg.get('tokens')} tokens in {len(cfg.get('lengths', []))} segments. "
            f"Outputs compared against `{e2e.get('outputs_compared_against')}`.",
            "",
            "| variant | ms / forward (wall) | GPU kernel ms / forward | plans / fwd | syncs / fwd | max diff (rel) | status |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in e2e["variants"].items():
            diff = next((v for k, v in r.items() if k.startswith("max_diff_vs_")), None)
            dcell = "" if diff is None else f"{diff:.2e} ({r.get('rel_diff', 0):.1e})" + (
                "" if r.get("agrees", True) else " **DISAGREES**"
            )
            st = r.get("status")
            if st != "ok":
                st = f"{st}: {(r.get('reason') or r.get('error') or '')[:200]}".replace("\n", " ").replace("|", "\\|")
            L.append(
                f"| {name} | {_f(r.get('ms_per_forward'), '{:.2f}')} | {_f(r.get('gpu_kernel_ms'), '{:.2f}')} | "
                f"{_f(r.get('plans_per_forward'), '{:.2f}')} | {_f(r.get('syncs_per_forward'), '{:.2f}')} | {dcell} | {st} |"
            )
        L.append("")
    return "\n".join(L) + "\n"
