"""Kernel tables of the benchmarks' `--profile` runs (scripts/bench/update.py, scripts/bench/rollout.py): the
top kernels of one torch.profiler run by total time, and GPU time by kernel kind."""

from __future__ import annotations

import re

import torch

KERNEL_KINDS = (  # first match wins
    ("triton (torch.compile)", r"^triton_"),
    ("attention", r"flash|fmha|attention|sdpa"),  # before gemm: cuDNN SDPA names say sm90
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|s16816|splitK|^aten::(mm|addmm|bmm)$"),
    ("nccl", r"nccl"),
    ("memcpy/memset", r"(?i)memcpy|memset"),
    ("norm", r"(?i)rms_?norm|layer_?norm|welford"),
    ("reduce", r"(?i)reduce|softmax|cross_?entropy|logsumexp"),
    ("adam", r"(?i)adam"),
    ("elementwise", r"(?i)elementwise|vectorized|unrolled|cat_?array|index|gather|scatter"),
)


def device_us(event) -> float:
    """A torch.profiler average's own CUDA time in microseconds (the attribute's name changed across torch
    versions)."""
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def kernel_table(prof, device: torch.device, path: str, wall_s: float, what: str = "one update") -> dict:
    """Top 30 kernels (CUDA) or ops (CPU) of `prof` by total time to `path`, and time by kernel kind; `what`
    names the profiled work in the table's header, `wall_s` its wall time."""
    cuda = device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if cuda:
            total = device_us(e)
        else:
            total = e.self_cpu_time_total
        if total > 0:
            rows.append((total / 1e3, e.count, e.key))
    rows.sort(reverse=True)
    all_ms = sum(r[0] for r in rows) or 1.0
    kinds: dict[str, float] = {}
    for ms, _, name in rows:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    unit = "CUDA kernels" if cuda else "CPU ops (self time)"
    lines = [f"top 30 {unit} of {what}; total {all_ms:.1f} ms over a wall time of {wall_s * 1e3:.1f} ms"]
    lines.append(f"{'total ms':>10} {'share':>6} {'calls':>6} {'avg us':>9}  name")
    for ms, count, name in rows[:30]:
        lines.append(f"{ms:10.2f} {ms / all_ms:6.1%} {count:6d} {ms * 1e3 / count:9.1f}  {name[:140]}")
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    try:  # torch's own view (names the ops that launched the kernels); cosmetic, never fatal
        own = prof.key_averages().table(sort_by=sort_by, row_limit=30)
    except Exception as e:
        own = f"unavailable: {e!r}"
    lines += ["", f"torch.profiler's table by {sort_by}:", own]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return {
        "profile": path,
        "kernel_ms": all_ms,
        "gpu_busy_fraction": all_ms / (wall_s * 1e3) if cuda else None,
        "kernel_categories": {
            k: {"ms": round(v, 2), "share": round(v / all_ms, 4)}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
    }
