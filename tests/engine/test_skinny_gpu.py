"""The skinny decode GEMM (engine/rollout/triton_skinny.py) on CUDA in bfloat16 at the 1.5B decode shapes (marked
`gpu`, skipped on CPU): as close to a float32 product as cuBLAS's bf16 GEMM is (within 1.5x its largest and mean
error), and the same bits eagerly and replayed from a CUDA graph, twice (the split-K tickets reset per call).
Its CPU check runs under Triton's interpreter (tests/engine/interpreted_triton.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.rollout import triton_skinny

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SHAPES_1_5B = {"qkv": (1536, 2048, True), "proj": (1536, 1536, False), "fc2": (8960, 1536, False)}


@pytest.mark.parametrize("name", sorted(SHAPES_1_5B))
@pytest.mark.parametrize("rows", [1, 8, 24, 64])
def test_skinny_linear_is_as_close_to_float32_as_cublas(name, rows):
    inp, out, bias = SHAPES_1_5B[name]
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, inp, device=DEV, generator=g).bfloat16()
    w = (torch.randn(out, inp, device=DEV, generator=g) / inp**0.5).bfloat16()
    b = torch.randn(out, device=DEV, generator=g).bfloat16() if bias else None
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    err_cublas = (F.linear(x, w, b).float() - ref).abs()
    y = triton_skinny.linear(x, w, b)
    err = (y.float() - ref).abs()
    assert err.max() <= 1.5 * err_cublas.max() + 1e-6, (float(err.max()), float(err_cublas.max()))
    assert err.mean() <= 1.5 * err_cublas.mean() + 1e-7, (float(err.mean()), float(err_cublas.mean()))

    graph, static = torch.cuda.CUDAGraph(), {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_skinny.linear(x, w, b)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static["y"] = triton_skinny.linear(x, w, b)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static["y"], y)


def test_output_head_at_a_real_vocabulary():
    """The 1.5B output head (151,936 columns) at 8 rows: the widest GEMM the skinny kernel serves."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(8, 1536, device=DEV, generator=g).bfloat16()
    w = (torch.randn(151936, 1536, device=DEV, generator=g) / 1536**0.5).bfloat16()
    ref = x.float() @ w.float().T
    err_cublas = (F.linear(x, w).float() - ref).abs()
    err = (triton_skinny.linear(x, w).float() - ref).abs()
    assert err.max() <= 1.5 * err_cublas.max() + 1e-6 and err.mean() <= 1.5 * err_cublas.mean() + 1e-7
