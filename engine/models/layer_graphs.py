"""CUDA graphs of the transformer layers' forward and backward for micro-batch shapes that repeat
(`trainer.cuda_graphs`).

A small micro-batch's update is bound by the host: each layer's forward and backward dispatches ~640 CPU ops
and ~70 kernel launches, ~5.6 ms of host time per layer at Qwen2.5-1.5B shapes against ~3.6 ms of GPU work
for 6,144 tokens (scripts/bench/README.md, "Why small micro-batches are slow"). A graph replays a layer's
kernels with one launch.

How: each layer's `forward` is wrapped (an instance attribute, so `layer(...)` reaches it). A call's signature
is its micro-batch's: the hidden states' shape and dtype, grad mode, and every other argument's shape
(tensors, `PackedSeqParams`' tensors) or value (lengths, formats); a call is keyed by its layer, that
signature and its input's strides (the first layer's input is the embedding's transposed output). The first
call of a key runs eagerly (Triton compiles, cuBLAS and attention plans warm up); the second captures the
layer's forward into a graph and replays it, and its backward, when autograd reaches it, is captured the
same way; later calls replay both. All graphs of one signature share one memory pool and are captured in
the order they run (layers forward, then backward in reverse), the order every later micro-batch of that
signature replays them in: so a layer's saved activations may share memory with another layer's temporaries
only where their lives do not overlap. A layer's input is copied into its graph's static input unless it
already is that tensor (the previous layer's graph output: no copy between layers); the packed rows'
boundaries and the like are shared by the signature's graphs and copied once per micro-batch.

Gradients: megatron's linear layers with `gradient_accumulation_fusion` sum their weight gradients into
`main_grad` inside the backward (engine/models/wgrad.py), so inside the graph; the layer's other parameters
(norm weights, the QKV bias) get their gradients as graph outputs, added to their `main_grad` after each
replay (what megatron DDP's hook does with `param.grad`, overlap_grad_reduce being off in this engine).

Valid while the parameters, `main_grad` buffers and pool keep their addresses and one micro-batch runs at a
time (no pipeline parallelism: engine/validate/run.py refuses trainer.cuda_graphs with PP > 1, TP > 1,
recompute or MoE). `release()` drops every graph and its memory; the roles call it after each update and
forward pass (the rollout needs the memory, and weights may move between steps).

Memory: a captured signature keeps one micro-batch's activations in its pool for as long as its graphs live
(~2.1x what the eager forward keeps, estimated: `CAPTURE_MEMORY`), on top of what eager micro-batches of
other shapes use: at most `max_shapes` signatures are captured (the first ones seen twice), and a new one only
where the device has CAPTURE_MEMORY x its eager forward's kept memory free; the rest run eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from engine.cuda_capture import capturing_on
from engine.models import packed_attention

MAX_SHAPES = 2
"""Signatures captured per `LayerGraphs` until `release()`; later ones run eagerly."""

CAPTURE_MEMORY = 2.5
"""A signature is captured only where the device has this many times the memory its layers' eager forwards
kept free. One H200, Qwen2.5-0.5B, 32,768-token micro-batches: the pool held 65 GB after 22 of 24 layers'
forwards, ~2.1x an estimate of their eager activations (~42 KB per token and layer), and ran out of memory
before this check existed."""


class _Static:
    """A tensor argument's static copy, shared by a signature's graphs; copied into once per new source (an
    inference tensor, which has no version counter, every time)."""

    def __init__(self, source: torch.Tensor):
        self.tensor = source.clone()
        self._source = self._stamp(source)

    @staticmethod
    def _stamp(source: torch.Tensor) -> tuple | None:
        return None if source.is_inference() else (weakref.ref(source), source._version)

    def load(self, source: torch.Tensor) -> None:
        stamp = self._stamp(source)
        if stamp is not None and self._source is not None and self._source[0]() is source:
            if self._source[1] == stamp[1]:
                return
        if source.data_ptr() != self.tensor.data_ptr():
            self.tensor.copy_(source)
        self._source = stamp


def _arguments(kwargs: dict) -> tuple[tuple, list[tuple[str, str | None, torch.Tensor]]] | None:
    """(the non-hidden arguments' part of a signature, their tensors as (name, field, tensor)); None when an
    argument is of a kind a graph cannot take (e.g. an inference context)."""
    parts, tensors = [], []
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.dtype, value.stride()))
            tensors.append((name, None, value))
        elif isinstance(value, PackedSeqParams):
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, torch.Tensor):
                    parts.append((name, f.name, tuple(v.shape), v.dtype))
                    tensors.append((name, f.name, v))
                elif v is None or isinstance(v, (int, str, bool)):
                    parts.append((name, f.name, v))
                else:
                    return None  # a process group: context parallelism
        elif value is None or isinstance(value, (int, float, str, bool)):
            parts.append((name, value))
        else:
            return None
    return tuple(parts), tensors


def _with_tensors(kwargs: dict, tensors: list[torch.Tensor], names: list[tuple[str, str | None]]) -> dict:
    """kwargs with its tensor arguments (named by `names`, in `_arguments`' order) replaced by `tensors`."""
    out = dict(kwargs)
    fields: dict[str, dict] = {}
    for (name, field), t in zip(names, tensors):
        if field is None:
            out[name] = t
        else:
            fields.setdefault(name, {})[field] = t
    for name, replaced in fields.items():
        out[name] = dataclasses.replace(kwargs[name], **replaced)
    return out


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on t's memory with its own version counter (`detach()` would share t's): copying the next
    micro-batch into a static input must not mark what the capture's autograd graph saved of it as modified
    (autograd then refuses to unpack it when the backward is captured)."""
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def cached_bytes(device: torch.device) -> int:
    """Memory the caching allocator holds on `device` without a tensor in it (what `empty_cache` can free)."""
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _fused_weights(layer: torch.nn.Module) -> set[int]:
    """ids of the weights whose gradients megatron's linear layers sum into `main_grad` themselves."""
    return {
        id(m.weight)
        for m in layer.modules()
        if getattr(m, "gradient_accumulation_fusion", False)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
    }


class _LayerGraph:
    """One layer's graphs for one signature: forward (always) and backward (when captured with grad)."""

    def __init__(self, owner: LayerGraphs, pool, layer: torch.nn.Module, hidden, kwargs, statics, names):
        self.owner, self.pool, self.statics = owner, pool, statics
        self.grad = torch.is_grad_enabled()
        self.x = owner.static_input(hidden)
        self.x_leaf = _alias(self.x).requires_grad_(self.grad)
        fused = _fused_weights(layer)
        named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad and id(p) not in fused]
        self.params = [p for _, p in named]
        # The other parameters enter the capture as fresh leaves on their storage: their gradients come out of
        # the backward graph, and the parameters' own AccumulateGrad nodes (made on the default stream, kept
        # by megatron DDP) would join a side-stream capture to that stream, which invalidates it.
        self.aliases = [_alias(p).requires_grad_(self.grad) for p in self.params]
        self.fwd = torch.cuda.CUDAGraph()
        call = _with_tensors(kwargs, [s.tensor for s in statics], names)
        call["hidden_states"] = self.x_leaf
        aliases = {n: a for (n, _), a in zip(named, self.aliases)}
        recurring = packed_attention.RECURRING
        mark = len(recurring.captured)
        with owner.capturing(
            self.fwd, pool, hidden
        ):  # `layer(...)` reaches LayerGraphs._call: captures pass on
            out, context = torch.func.functional_call(layer, aliases, (), call, strict=False)
        self.attention_shapes = recurring.captured[mark:]  # counted per replay: see RecurringShapes
        del recurring.captured[mark:]
        if context is not None:
            raise RuntimeError("trainer.cuda_graphs: a layer returned a context tensor (cross-attention)")
        self.captured_out = out  # holds the autograd graph of the capture until the backward is captured
        self.out = out.detach()
        owner.outputs[self.out.data_ptr()] = self.out
        self.bwd: torch.cuda.CUDAGraph | None = None
        self.gout = self.gx = None
        self.grads: list[torch.Tensor] = []
        self.main_grads: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
        if hidden.data_ptr() != self.x.data_ptr():
            self.x.copy_(hidden)
        for s, t in zip(self.statics, tensors):
            s.load(t)
        self.fwd.replay()
        packed_attention.RECURRING.replayed(self.attention_shapes)
        return self.out.detach()  # a new tensor object each call: autograd sets its grad_fn on it

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.bwd is None:
            try:
                self._capture_backward(grad)
            except RuntimeError as error:
                raise RuntimeError(
                    f"trainer.cuda_graphs: capturing a layer's backward failed ({error}); set "
                    "trainer.cuda_graphs=false"
                ) from error
        elif grad.data_ptr() != self.gout.data_ptr():
            self.gout.copy_(grad)
        self.bwd.replay()
        if self.grads:
            torch._foreach_add_(self.main_grads, self.grads)
        return self.gx

    def _capture_backward(self, grad: torch.Tensor) -> None:
        self.gout = self.owner.static_input(grad)  # the next layer's gradient output if it is that: no copy
        self.bwd = torch.cuda.CUDAGraph()
        with self.owner.capturing(self.bwd, self.pool, grad):
            grads = torch.autograd.grad(
                self.captured_out, [self.x_leaf, *self.aliases], self.gout, allow_unused=True
            )
        self.captured_out = None
        self.gx = grads[0].detach()
        self.owner.outputs[self.gx.data_ptr()] = self.gx
        kept = [(p, g) for p, g in zip(self.params, grads[1:]) if g is not None]
        for p, _ in kept:
            if getattr(p, "main_grad", None) is None:
                raise RuntimeError(
                    "trainer.cuda_graphs: a trainable layer parameter has no main_grad (not under megatron "
                    "DDP); set trainer.cuda_graphs=false"
                )
        self.main_grads = [p.main_grad for p, _ in kept]
        self.grads = [g.detach() for _, g in kept]


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: _LayerGraph, tensors: list[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        ctx.graph = graph
        return graph.forward(hidden, tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, ctx.graph.backward(grad)


class LayerGraphs:
    """Wraps the forward of every transformer layer of `models` (GPTModels, DDP-wrapped or not) to run it
    from CUDA graphs for signatures that repeat (module docstring); `eager`/`captured`/`replayed` count the
    layer calls it could graph (on CUDA) by how they ran."""

    def __init__(self, models: list[torch.nn.Module], max_shapes: int = MAX_SHAPES):
        self.max_shapes = max_shapes
        self.layers = [layer for m in models for layer in getattr(m, "module", m).decoder.layers]
        self.stream: torch.cuda.Stream | None = None
        self.eager_calls = self.captured = self.replayed = 0
        self._taken = (0, 0, 0)
        self.release()
        for index, layer in enumerate(self.layers):
            layer.forward = functools.partial(self._call, index, layer, layer.forward)

    def release(self) -> None:
        """Drop every graph, static tensor and pool (and the counts of calls per signature)."""
        self.graphs: dict[tuple, _LayerGraph] = {}
        self.calls: dict[tuple, int] = {}
        self.pools: dict[tuple, object] = {}
        self.statics: dict[tuple, _Static] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.start: dict[tuple, int] = {}
        self.growth: dict[tuple, int] = {}
        self.eager: set[tuple] = set()

    def _call(self, index: int, layer: torch.nn.Module, forward, *args, **kwargs):
        hidden = kwargs.pop("hidden_states", None)
        arguments = None if args or hidden is None or not _on_cuda(hidden) else _arguments(kwargs)
        if arguments is None or torch.cuda.is_current_stream_capturing():
            return forward(*args, hidden_states=hidden, **kwargs)
        parts, tensors = arguments
        grad = torch.is_grad_enabled()
        if grad and not hidden.requires_grad:  # a frozen embedding: the layers' gradients need autograd here
            return forward(hidden_states=hidden, **kwargs)
        sig = (tuple(hidden.shape), hidden.dtype, grad, parts)  # the micro-batch's: one pool for its layers
        key = (index, sig, hidden.stride())  # the first layer's input is the embedding's strided output
        graph = self.graphs.get(key)
        if graph is None:
            self.calls[key] = self.calls.get(key, 0) + 1
            if self.calls[key] < 2 or not self._may_capture(sig, hidden.device):
                return self._eager(index, sig, forward, hidden, kwargs)
            pool = self.pools.setdefault(sig, torch.cuda.graph_pool_handle())
            names = [(name, field) for name, field, _ in tensors]
            statics = [self._shared_static(sig, name, field, t) for name, field, t in tensors]
            try:
                graph = _LayerGraph(self, pool, layer, hidden, kwargs, statics, names)
            except RuntimeError as error:
                raise RuntimeError(
                    f"trainer.cuda_graphs: capturing layer {index}'s forward failed ({error}); set "
                    "trainer.cuda_graphs=false"
                ) from error
            self.graphs[key] = graph
            self.captured += 1
        else:
            self.replayed += 1
        values = [t for _, _, t in tensors]
        if graph.grad:
            return _Replay.apply(graph, values, hidden), None
        return graph.forward(hidden, values), None

    def counts_since_last(self) -> tuple[int, int, int]:
        """(eager, captured, replayed) layer calls since the last call of this (the trainer's per-step metric
        `perf/cuda_graph_replayed_fraction`)."""
        now = (self.eager_calls, self.captured, self.replayed)
        out = tuple(a - b for a, b in zip(now, self._taken))
        self._taken = now
        return out

    def _eager(self, index: int, sig: tuple, forward, hidden: torch.Tensor, kwargs: dict):
        """The layer run eagerly; over a signature's first micro-batch, the memory its layers' forwards keep
        (what its graphs' pool will hold, and more) is measured for `_may_capture`."""
        self.eager_calls += 1
        first = sig not in self.growth and sig[2]
        if first and index == 0:
            self.start[sig] = torch.cuda.memory_allocated(hidden.device)
        out = forward(hidden_states=hidden, **kwargs)
        if first and index == len(self.layers) - 1 and sig in self.start:
            self.growth[sig] = torch.cuda.memory_allocated(hidden.device) - self.start[sig]
        return out

    def _may_capture(self, sig: tuple, device: torch.device) -> bool:
        """Whether `sig` is (or may now be) captured: at most `max_shapes` signatures, a new one only where
        the device has CAPTURE_MEMORY x its eager forward's kept memory free. Where the driver's free memory
        is short but would do with the allocator's cached blocks, the cache is emptied first: a capture's
        allocations cannot take the cached blocks themselves (an eager micro-batch's freed blocks stay
        reserved outside the graphs' pool). Not emptied where that would not free enough: the blocks the
        rollout and the update reuse would go back to the driver for nothing and be allocated again.
        (One H200: with the cache emptied before every call's capture, the 0.5B long tail to 1,024 generated
        0.17-0.29 s per step slower than without graphs in 3 of 3 pairs of runs; emptied only where short,
        2.567 s against 2.556 s eager in one call. The 1.5B step with 32,768-token micro-batches, nothing
        captured: emptied where short whether or not that could free enough, 9.86 s per step against 8.74 s
        eager; emptied only where it frees enough, 8.76 s against 8.66 s, in another call.)"""
        if sig in self.pools:
            return True
        if sig in self.eager or len(self.pools) >= self.max_shapes:
            return False
        need = CAPTURE_MEMORY * self.growth.get(sig, 0)
        free = torch.cuda.mem_get_info(device)[0]
        if free < need <= free + cached_bytes(device):
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
        if free < need:
            self.eager.add(sig)
            return False
        return True

    def _shared_static(self, sig: tuple, name: str, field: str | None, t: torch.Tensor) -> _Static:
        key = (sig, name, field)
        if key not in self.statics:
            self.statics[key] = _Static(t)
        return self.statics[key]

    def static_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The graph's static input: `hidden` itself when it is a graph output of this object (the previous
        layer's), else a copy."""
        owned = self.outputs.get(hidden.data_ptr())
        if owned is not None and owned.shape == hidden.shape and owned.stride() == hidden.stride():
            return owned
        return hidden.detach().clone()

    @property
    def side_stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    def capturing(self, graph: torch.cuda.CUDAGraph, pool, source: torch.Tensor):
        """Capture into `graph` on the side stream (one stream for every capture: a backward runs on its
        forward's stream), into its signature's `pool` (engine/cuda_capture.py)."""
        return capturing_on(graph, pool, self.side_stream, source.device)
