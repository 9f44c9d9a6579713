"""Kernel tables of the benchmarks' `--profile` runs (scripts/bench/update.py, scripts/bench/rollout.py): the
top kernels of one torch.profiler run by total time, and GPU time by kernel kind; and the op log of
update.py's `--log-ops` (`OpLog`: which elementwise, copy and reduction ops run, on what and from where)."""

from __future__ import annotations

import re
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


DATA_OPS = frozenset(
    ("add", "add_", "sub", "mul", "mul_", "div", "neg", "sum", "cat", "stack", "clone", "copy_", "_to_copy")
    + ("zero_", "fill_", "where", "masked_fill", "index_select", "embedding_dense_backward")
)
"""The ops an op log records: elementwise, copies and reductions (what runs outside the GEMMs and the
attention and fused kernels, which dispatch as one op each)."""


class OpLog(TorchDispatchMode):
    """Records each `DATA_OPS` call on a tensor of at least `min_elements` elements: its op, the shapes,
    strides and dtypes of those tensors, the autograd node running it (backward) and the last Python frames
    that called it (forward), with the bytes of those tensors. Compiled regions run eagerly under the mode,
    so ops inside them are listed though on the device they run fused."""

    def __init__(self, min_elements: int):
        super().__init__()
        self.min_elements = min_elements
        self.calls: dict[tuple, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in DATA_OPS:
            first = args[0] if args else None
            tensors = list(first) if isinstance(first, (list, tuple)) else list(args)
            big = [t for t in tensors if isinstance(t, torch.Tensor) and t.numel() >= self.min_elements]
            if big:
                node = torch._C._current_autograd_node()
                frames = [
                    f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                    for f in traceback.extract_stack()[:-1]
                    if not re.search(r"torch/(utils|autograd|_compile|overrides|_dynamo)", f.filename)
                ][-3:]
                shapes = tuple((tuple(t.shape), t.stride(), str(t.dtype)[6:]) for t in big[:2])
                key = (name, type(node).__name__ if node is not None else "-", shapes, tuple(frames))
                entry = self.calls.setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] += sum(t.numel() * t.element_size() for t in big)
        return func(*args, **(kwargs or {}))

    def write(self, path: str, what: str) -> None:
        """The recorded calls by bytes, largest first, to `path`."""
        total = sum(b for _, b in self.calls.values())
        lines = [f"ops of {what} on tensors of >= {self.min_elements} elements; {total / 1e9:.2f} GB touched"]
        lines.append(f"{'calls':>6} {'GB':>7}  op, autograd node, (shape, strides, dtype) of the first two")
        for (name, node, shapes, frames), (count, nbytes) in sorted(
            self.calls.items(), key=lambda kv: -kv[1][1]
        ):
            lines.append(f"{count:6d} {nbytes / 1e9:7.2f}  {name} {node} {shapes}")
            lines += [f"{'':16}{frame}" for frame in frames]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
