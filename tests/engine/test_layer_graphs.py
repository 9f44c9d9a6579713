"""trainer.cuda_graphs on CPU (engine/models/layer_graphs.py; the graphs themselves run in
tests/engine/test_layer_graphs_gpu.py): a layer call's signature and its tensors, the arguments rebuilt around
static tensors, the refusals of engine/validate/run.py, and a CPU model's layers passing through unchanged."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from config_compose import composed
from megatron.core.packed_seq_params import PackedSeqParams

from engine.config import ConfigError
from engine.models import layer_graphs
from engine.validate.built import built_model
from engine.validate.run import layer_graphs_on, validate_cuda_graphs


def _params(cu: torch.Tensor, longest: int) -> PackedSeqParams:
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def test_signature_holds_shapes_and_values_not_contents():
    rope = torch.zeros(16, 1, 1, 8)
    a = _params(torch.tensor([0, 5, 9], dtype=torch.int32), 5)
    b = _params(torch.tensor([0, 4, 9], dtype=torch.int32), 5)  # other boundaries, same shapes and longest
    c = _params(torch.tensor([0, 3, 9], dtype=torch.int32), 6)
    sig_a, tensors = layer_graphs._arguments({"rotary_pos_emb": rope, "packed_seq_params": a, "mask": None})
    sig_b, _ = layer_graphs._arguments({"rotary_pos_emb": rope, "packed_seq_params": b, "mask": None})
    sig_c, _ = layer_graphs._arguments({"rotary_pos_emb": rope, "packed_seq_params": c, "mask": None})
    assert sig_a == sig_b != sig_c  # the longest row sizes FlashAttention's grid: part of the signature
    assert [(n, f) for n, f, _ in tensors] == [
        ("packed_seq_params", "cu_seqlens_q"),
        ("packed_seq_params", "cu_seqlens_kv"),
        ("rotary_pos_emb", None),
    ]
    assert tensors[0][2] is a.cu_seqlens_q and tensors[2][2] is rope
    assert layer_graphs._arguments({"inference_context": object()}) is None


def test_arguments_are_rebuilt_around_static_tensors():
    params = _params(torch.tensor([0, 5, 9], dtype=torch.int32), 5)
    kwargs = {"rotary_pos_emb": torch.ones(3), "packed_seq_params": params, "attention_mask": None}
    _, tensors = layer_graphs._arguments(kwargs)
    statics = [t.clone() + 1 for _, _, t in tensors]
    rebuilt = layer_graphs._with_tensors(kwargs, statics, [(n, f) for n, f, _ in tensors])
    assert rebuilt["packed_seq_params"].cu_seqlens_q is statics[0]
    assert rebuilt["packed_seq_params"].cu_seqlens_kv is statics[1]
    assert rebuilt["packed_seq_params"].max_seqlen_q == 5 and rebuilt["attention_mask"] is None
    assert rebuilt["rotary_pos_emb"] is statics[2]
    assert kwargs["packed_seq_params"] is params and params.cu_seqlens_q.tolist() == [0, 5, 9]  # untouched


def test_static_copies_once_per_source():
    source = torch.arange(4)
    static = layer_graphs._Static(source)
    assert static.tensor.data_ptr() != source.data_ptr() and static.tensor.tolist() == [0, 1, 2, 3]
    other = torch.arange(4) * 2
    static.load(other)
    assert static.tensor.tolist() == [0, 2, 4, 6]
    other.add_(1)  # the same tensor, modified: copied again
    static.load(other)
    assert static.tensor.tolist() == [1, 3, 5, 7]
    with torch.inference_mode():
        frozen = torch.arange(4) * 3
    static.load(frozen)
    static.tensor.zero_()
    static.load(frozen)  # no version counter to trust: copied every time
    assert static.tensor.tolist() == [0, 3, 6, 9]


def _on_cuda(cfg):
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device="cuda"))


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["parallel.pp=2"], "no pipeline parallelism (parallel.pp=2)"),
        (["parallel.tp=2"], "parallel.tp=1 only"),
        (["model.recompute=true"], "model.recompute=true"),
        (["model=tiny_moe"], "mixture-of-experts"),
        ([], "half precision"),  # the tiny model: float32, packed
    ],
)
def test_cuda_graphs_refuse_layouts_they_cannot_replay(overrides, needle):
    cfg = _on_cuda(composed("trainer.cuda_graphs=true", *overrides))
    with pytest.raises(ConfigError, match="trainer.cuda_graphs=True") as err:
        validate_cuda_graphs(cfg, cfg.model)
    assert needle in str(err.value) and "Fix:" in str(err.value)
    validate_cuda_graphs(composed(*overrides), cfg.model)  # off: nothing to refuse


@pytest.mark.parametrize("overrides", [["model.dtype=bfloat16"], ["trainer.pack_sequences=false"]])
def test_cuda_graphs_take_half_precision_or_padded_rows(overrides):
    cfg = _on_cuda(composed("trainer.cuda_graphs=true", *overrides))
    validate_cuda_graphs(cfg, cfg.model)


@pytest.mark.parametrize(
    "overrides,cuda,on",
    [
        # the default (null): on where nothing blocks it, in bf16, with micro-batches by rows
        (["model.dtype=bfloat16", "trainer.micro_batch_size=8"], True, True),
        (["model.dtype=bfloat16", "trainer.pack_sequences=false"], True, True),  # padded rows
        (["model.dtype=bfloat16"], True, False),  # packed, no size: sized by memory, GPU-bound
        (["model.dtype=bfloat16", "trainer.micro_batch_size=8"], False, False),  # CPU
        ([], True, False),  # the tiny model's float32, packed
        (["trainer.pack_sequences=false"], True, False),  # float32 padded: allowed, but only bf16 by default
        (["model.dtype=float16"], True, False),  # loss scaling not yet run with graphs: only when asked
        (["model.dtype=bfloat16", "trainer.micro_batch_size=8", "parallel.tp=2"], True, False),
        (["model.dtype=bfloat16", "parallel.pp=2"], True, False),
        (["model.dtype=bfloat16", "trainer.micro_batch_size=8", "model.recompute=true"], True, False),
        (["model=tiny_moe", "model.dtype=bfloat16", "trainer.micro_batch_size=8"], True, False),
        (["model.dtype=bfloat16", "trainer.max_tokens_per_micro_batch=4096"], True, False),  # GPU-bound sizes
        (
            ["model.dtype=bfloat16", "trainer.max_tokens_per_micro_batch=4096", "trainer.cuda_graphs=true"],
            True,
            True,
        ),
        (["model.dtype=bfloat16", "trainer.cuda_graphs=false"], True, False),
        (["model.dtype=float16", "trainer.cuda_graphs=true"], True, True),
        (["trainer.pack_sequences=false", "trainer.cuda_graphs=true"], True, True),
    ],
)
def test_layer_graphs_on_by_default_where_they_apply(overrides, cuda, on):
    """trainer.cuda_graphs left empty turns the graphs on wherever validation would accept true, in bf16 with
    micro-batches by rows (no token budget, not sized by memory); elsewhere empty is quietly off (and validation
    passes)."""
    cfg = composed(*overrides)
    cfg = _on_cuda(cfg) if cuda else cfg
    validate_cuda_graphs(cfg, built_model(cfg))
    assert layer_graphs_on(cfg, built_model(cfg)) is on


def test_cpu_layers_pass_through(groups):
    from engine.config import ModelConfig
    from engine.models.builder import build_gpt_chunks, resolve_shape

    m = ModelConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2
    )
    shape = resolve_shape(m, 40, 1)
    torch.manual_seed(0)
    (model,) = build_gpt_chunks(shape, groups, init_std=0.2, recompute=False)
    tokens = torch.randint(0, 40, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    want = model(tokens, positions, None)
    graphs = layer_graphs.LayerGraphs([model])
    got = model(tokens, positions, None)
    got.sum().backward()
    assert torch.equal(got, want) and graphs.captured == graphs.replayed == 0 and not graphs.calls
    assert all(p.grad is not None for p in model.decoder.layers.parameters())


def test_captures_neither_count_towards_cudnn_nor_build_its_plan(monkeypatch):
    from engine.models import packed_attention

    rec, shape, capturing = packed_attention.RecurringShapes(), ("rows", 4, 64), [True]
    monkeypatch.setattr(packed_attention, "CUDNN_FROM_CALL", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert [rec(shape), rec(shape)] == [False, False] and shape not in rec.calls  # captured: FlashAttention
    capturing[0] = False
    assert [rec(shape), rec(shape)] == [False, True]  # eager: the 2nd call takes cuDNN (and builds its plan)
    capturing[0] = True
    assert rec(shape) and rec.calls[shape] == 2  # captured after it: cuDNN, uncounted


class _FakeGraph:
    """Stands in for a captured layer (no CUDA here): records its capture, runs the layer's own forward."""

    made: list[int] = []

    def __init__(self, owner, pool, layer, hidden, kwargs, statics, names):
        self.grad, self.layer, self.kwargs = False, layer, kwargs
        _FakeGraph.made.append(owner.layers.index(layer))

    def forward(self, hidden, tensors):
        return self.layer.forward.args[2](hidden_states=hidden, **self.kwargs)[0]


def test_capture_policy_second_micro_batch_max_shapes_and_memory(groups, monkeypatch):
    """A signature is captured on its second micro-batch (every layer), replayed after; a third shape is not
    captured past max_shapes=2; a shape whose eager forward kept more than free memory / CAPTURE_MEMORY is
    not captured; release() starts over. Memory and the device are stubbed; the graph is `_FakeGraph`."""
    from engine.config import ModelConfig
    from engine.models.builder import build_gpt_chunks, resolve_shape

    m = ModelConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2
    )
    torch.manual_seed(0)
    (model,) = build_gpt_chunks(resolve_shape(m, 40, 1), groups, init_std=0.2, recompute=False)
    allocated = itertools.cycle([0, 20])  # read before the first layer, after the last: the forward keeps 20

    monkeypatch.setattr(layer_graphs, "_LayerGraph", _FakeGraph)
    monkeypatch.setattr(layer_graphs, "_on_cuda", lambda t: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    emptied = []  # the cache is emptied only where the free memory is short and the cache would make it up
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(free[0]))
    free, cached = [100], [0]
    monkeypatch.setattr(layer_graphs, "cached_bytes", lambda device: cached[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 1000))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    _FakeGraph.made = []
    graphs = layer_graphs.LayerGraphs([model])

    def micro_batch(length: int, grad: bool = False) -> torch.Tensor:
        tokens = torch.randint(0, 40, (1, length))
        with torch.set_grad_enabled(grad):
            return model(tokens, torch.arange(length)[None], None)

    micro_batch(5)
    assert _FakeGraph.made == [] and graphs.captured == 0  # first: eager, its memory measured
    micro_batch(5)
    assert _FakeGraph.made == [0, 1] and graphs.captured == 2 and graphs.replayed == 0  # second: captured
    micro_batch(5)
    assert graphs.captured == 2 and graphs.replayed == 2  # third: replayed
    micro_batch(6), micro_batch(6)
    assert graphs.captured == 4  # a second shape
    micro_batch(7), micro_batch(7)
    assert graphs.captured == 4 and len(graphs.pools) == 2  # a third: past max_shapes, eager
    graphs.release()
    free[0] = 20 * layer_graphs.CAPTURE_MEMORY - 1  # less than CAPTURE_MEMORY x a forward's kept 20
    micro_batch(5, grad=True), micro_batch(5, grad=True)
    assert graphs.captured == 4 and graphs.eager and not graphs.pools  # too little memory: eager
    assert emptied == []  # and the cache holds too little to make it up: not emptied
    graphs.release()
    cached[0] = 1  # free + cached is enough: emptied once (the stub frees nothing), then eager
    micro_batch(5, grad=True), micro_batch(5, grad=True)
    assert graphs.captured == 4 and graphs.eager and emptied == [free[0]]
    graphs.release()
    free[0] = 20 * layer_graphs.CAPTURE_MEMORY
    assert graphs.counts_since_last() == (4 * 2 + 2 * 4, 4, 2)  # (eager, captured, replayed) layer calls
    micro_batch(5, grad=True), micro_batch(5, grad=True)
    assert graphs.captured == 6 and graphs.counts_since_last() == (2, 2, 0)
