"""How every benchmark in bench/ times things: one module, so numbers from
different scripts mean the same.

* :func:`time_fn`: one callable, back to back (per-op rows, training steps).
* :func:`mean_ms`: CUDA-event time of ``reps`` calls back to back, per call.
* :func:`interleaved`: several callables measured in rotating rounds, so drift
  (clocks, heat, a neighbour's load) hits all alike.
* :func:`time_steps`: a sequence of different steps, back to back (graph mode:
  wall, host and GPU ms per step).
* :func:`gpu_queued_ms`: GPU time of one step with the host out of the way.
* :func:`call_ms` / :func:`host_ms`: host wall time of each call (whole
  forwards synced; planning costs).
* :func:`kernel_times`: torch.profiler CUDA time per kernel name per step.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch


def sync(dev: torch.device | str | None = None) -> None:
    dev = torch.device(dev) if dev is not None else None
    if dev is None or dev.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(dev)


def median(xs):
    return float(statistics.median(xs)) if xs else None


def time_fn(fn, dev: torch.device | str = "cuda", *, warmup: int = 1, min_reps: int = 20,
            max_reps: int | None = None, target_s: float = 0.0) -> dict:
    """Time ``fn()`` called back to back; ``reps`` is at least ``min_reps``,
    enough for ``target_s`` seconds of timed work, at most ``max_reps``.

    CUDA: ``ms`` is the median of CUDA-event time around each call (what the
    stream sees: host gaps count if the host is the bottleneck); ``mean_ms`` is
    event time around a second run of ``reps`` calls divided by ``reps``;
    ``wall_ms`` the host wall clock of that run per call. CPU: ``ms`` is the
    median ``perf_counter`` time per call, ``mean_ms`` = ``wall_ms`` its mean.
    """
    dev = torch.device(dev)
    max_reps = max(min_reps, max_reps if max_reps is not None else min_reps)
    for _ in range(warmup):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(min_reps, target_s / est)))
    if dev.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(dev)
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        mean, wall = mean_ms(fn, dev, reps, warmup=0)
        method = "cuda_events_back_to_back"
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        wall = mean = sum(times) / len(times)
        method = "perf_counter"
    return {
        "ms": median(times),
        "ms_min": times[0],
        "ms_p10": times[len(times) // 10],
        "ms_p90": times[(len(times) * 9) // 10],
        "mean_ms": mean,
        "wall_ms": wall,
        "reps": reps,
        "timing": method,
    }


def mean_ms(fn, dev, reps: int, warmup: int = 1) -> tuple[float, float]:
    """(CUDA-event ms, host wall ms) per call of ``reps`` calls of ``fn()`` back to back."""
    for _ in range(warmup):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(dev)
    t0 = time.perf_counter()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    sync(dev)
    return s.elapsed_time(e) / reps, (time.perf_counter() - t0) / reps * 1e3


def interleaved(fns: dict, rounds: int, measure) -> dict:
    """``measure(fn)`` of every value of ``fns`` in ``rounds`` rounds, the order
    rotating by one each round; the list of measurements per key."""
    names, out = list(fns), {k: [] for k in fns}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(measure(fns[name]))
    return out


def call_ms(fn, dev, reps: int, *, synced: bool = True, warmup: int = 0) -> list[float]:
    """Host wall ms of each of ``reps`` calls of ``fn()``, synced before each; with
    ``synced`` the sync after the call is timed too (a whole forward's latency)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        if synced:
            sync(dev)
        ts.append((time.perf_counter() - t0) * 1e3)
    sync(dev)
    return ts


def host_ms(fn, dev, reps: int) -> float:
    """Median host wall time of ``fn()`` until it returns (synced before, untimed after)."""
    return median(call_ms(fn, dev, reps, synced=False))


def time_steps(steps) -> dict:
    """Run the zero-argument callables ``steps`` back to back (CUDA): wall ms per
    step over the whole run, median host ms until each call returns (no sync) and
    median GPU ms between CUDA events around each step."""
    torch.cuda.synchronize()
    host, starts, ends = [], [], []
    t0 = time.perf_counter()
    for step in steps:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        s.record()
        step()
        e.record()
        host.append((time.perf_counter() - h0) * 1e3)
        starts.append(s)
        ends.append(e)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / len(host)
    gpu = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    h = statistics.median(host)
    return {
        "wall_ms": round(wall, 3),
        "host_ms": round(h, 3),
        "gpu_ms": round(gpu, 3),
        "wall_minus_gpu_ms": round(wall - gpu, 3),
    }


def gpu_queued_ms(fn, reps: int = 9) -> float:
    """GPU time of one ``fn()`` when the host is not the bottleneck: events around
    a call issued behind a GPU sleep, so launches land before the GPU gets there."""
    times = []
    for _ in range(reps):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return round(statistics.median(times), 3)


def kernel_times(fn, steps: int = 5, top: int = 25) -> dict:
    """torch.profiler CUDA time per step: ``total_ms`` (all kernels, memcpy and
    memset), ``kernels_per_step`` and the ``top`` kernel names with ms per step."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    acc = defaultdict(float)
    count = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name[:90]] += ev.device_time_total / 1e3 / steps
            count += 1
    ranked = sorted(acc.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": round(sum(acc.values()), 3),
        "kernels_per_step": count / steps,
        "top": [(n, round(t, 3)) for n, t in ranked],
    }
