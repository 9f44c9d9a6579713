"""A stand-in for the parts of vLLM 0.26 that engine/rollout/vllm_backend.py calls, so that CPU tests drive the
backend's whole control flow (construction, sleep / wake-up, weight copy, requests, outputs) without vLLM.

Signatures, validation and state follow the 0.26 source: `LLM` (vllm/entrypoints/llm.py; keyword arguments
of EngineArgs), `SamplingParams` (vllm/sampling_params.py `_verify_args`), sleep / wake-up tags
(vllm/v1/engine/core.py, vllm/v1/executor/abstract.py: the scheduler resumes only once every tag is awake;
a tag that is not asleep makes wake_up a no-op), the external launcher's environment
(vllm/v1/executor/uniproc_executor.py), stop checks (vllm/v1/core/sched/utils.py) and the output objects
(vllm/outputs.py, vllm/logprobs.py; with `logprobs=None` a completion's `logprobs` and `cumulative_logprob` are
None, as vllm/v1/engine/logprobs.py `LogprobsProcessor.from_new_request` leaves them). Its "model" draws tokens from the request seed alone: it checks how the
backend drives vLLM, not numerics (the GPU tests do that), unless a test hands `install` a `logits_fn`
(token ids -> next-token logits): then each step runs vLLM 0.26's sampler (vllm/v1/worker/gpu/sample/
sampler.py) on those logits: float32, temperature (not when greedy), top-k then top-p set dropped tokens to
-inf (vllm/v1/sample/ops/topk_topp_sampler.py), a seeded draw; and the sampled token's log-prob follows
`logprobs_mode`: "raw_logprobs" (vLLM's default) is log_softmax of the logits as the model returned them,
"processed_logprobs" log_softmax of the logits the token was drawn from (after temperature and truncation).
"""

from __future__ import annotations

import json
import os
import random
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# EngineArgs fields of vLLM 0.26 the backend may pass (vllm/engine/arg_utils.py)
ENGINE_ARGS = {
    "model",
    "skip_tokenizer_init",
    "load_format",
    "dtype",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_model_len",
    "enable_sleep_mode",
    "enforce_eager",
    "seed",
    "logprobs_mode",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "moe_backend",
}
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(kw_only=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True

    def __post_init__(self):
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value != -1 and value < 0:
                raise ValueError(f"{name} must be non-negative or -1, got {value}.")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if self.temperature < 1e-5:  # greedy: vLLM turns truncation off
            self.top_p, self.top_k = 1.0, 0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed {self.seed} does not fit the sampler's int64 seeds")


def TokensPrompt(**fields) -> dict:  # a TypedDict in vLLM: calling it builds a dict
    return dict(fields)


class _Model:
    """named_parameters() of vLLM's model on this rank (the tensors the test hands in)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = {name: torch.nn.Parameter(t, requires_grad=False) for name, t in params.items()}

    def named_parameters(self):
        return iter(self.params.items())


@dataclass
class _Engine:
    """LLM.llm_engine: sleep state as vllm/v1/executor/abstract.py keeps it."""

    vllm_config: types.SimpleNamespace
    sleeping_tags: set[str] = field(default_factory=set)
    paused: bool = False

    def is_sleeping(self) -> bool:
        return self.paused or bool(self.sleeping_tags)


class RequestOutput(types.SimpleNamespace):
    """vllm/outputs.py RequestOutput's fields the backend reads (weak-referenceable, for `LLM.outputs_alive_at_sleep`)."""


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vllm/v1/sample/ops/topk_topp_sampler.py `apply_top_k_top_p` on one row (vocab,): the k largest logits
    kept (ties included), then the smallest set of the most likely tokens whose mass reaches top_p (sorted
    ascending, the tokens whose cumulative probability stays <= 1 - top_p dropped, the most likely kept)."""
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        ascending, index = logits.sort()
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[-1] = False
        logits = logits.clone()
        logits[index[drop]] = float("-inf")
    return logits


class LLM:
    instances: list[LLM] = []
    model_params: dict[str, torch.Tensor] = {}
    """Set by the test before the backend builds its LLM: the parameters vLLM's model would have."""
    logits_fn: Callable[[list[int]], torch.Tensor] | None = None
    """Set by the test: token ids -> next-token logits (vocab,), the model the sampler runs on (module
    docstring); None: tokens from the request seed alone."""

    def __init__(self, model: str, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={kwargs['logprobs_mode']!r}")
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        if self.logprobs_mode not in (
            "processed_logprobs",
            "raw_logprobs",
        ):  # as the V2 model runner's Sampler
            raise NotImplementedError(f"Unsupported logprobs_mode: {self.logprobs_mode}")
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
                raise AssertionError("please set VLLM_ENABLE_V1_MULTIPROCESSING=0")
            for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ[key]  # noqa: B018  (KeyError as in ExecutorWithExternalLauncher)
            if not dist.is_initialized() or int(os.environ["RANK"]) != dist.get_rank():
                raise AssertionError("external_launcher: RANK must be this rank of the job's world")
        with open(os.path.join(model, "config.json")) as f:
            self.vocab_size = json.load(f)["vocab_size"]
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "VLLM_ENABLE_V1_MULTIPROCESSING")}
        self.model = _Model(LLM.model_params)
        self.llm_engine = _Engine(types.SimpleNamespace(use_v2_model_runner=True))
        self.calls: list[str] = []
        self._outputs: list[weakref.ref] = []
        self.outputs_alive_at_sleep: list[int] = []
        """Per sleep() call: how many outputs of the latest generate() were still referenced (vLLM's sleep runs
        gc.collect(), which walks every live object)."""
        self.out_of_memory_on: str | None = None
        """A sleep tag whose wake_up runs out of device memory (set by a test)."""
        self.last_params: list[SamplingParams] = []
        """The per-request SamplingParams of the latest generate call (what the backend asked vLLM for)."""
        LLM.instances.append(self)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(f"sleep({level})")
        self.outputs_alive_at_sleep.append(sum(ref() is not None for ref in self._outputs))
        self.llm_engine.paused = True
        if level >= 1 and not self.llm_engine.sleeping_tags:
            self.llm_engine.sleeping_tags = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({tags})")
        if self.out_of_memory_on in (tags or []):  # what vLLM 0.26's cumem allocator raises
            raise RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163")
        engine = self.llm_engine
        if tags and any(tag not in engine.sleeping_tags for tag in tags):
            return  # vLLM logs "Tag ... is not in sleeping tags" and does nothing
        engine.sleeping_tags -= set(tags) if tags else set(engine.sleeping_tags)
        if not engine.sleeping_tags:
            engine.paused = False

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def apply_model(self, func):
        self.calls.append("apply_model")
        if "weights" in self.llm_engine.sleeping_tags:
            raise RuntimeError("apply_model on weights that are asleep (unmapped memory on a GPU)")
        return [func(self.model)]

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kwargs):
        self.calls.append("generate")
        if self.llm_engine.is_sleeping():
            raise RuntimeError("generate() on a sleeping engine would spin forever in vLLM")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        self.last_params = list(params)
        outputs = [self._one(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        self._outputs = [weakref.ref(o) for o in outputs]
        return outputs

    def _one(self, index: int, prompt: dict, sp: SamplingParams):
        ids = prompt["prompt_token_ids"]
        if not all(0 <= t < self.vocab_size for t in ids):
            raise ValueError("prompt token id out of vocabulary")
        tokens, token_logprobs = self._sample(ids, sp) if LLM.logits_fn else self._draw(ids, sp)
        reason = "stop" if tokens[-1] in sp.stop_token_ids else "length"
        logprobs, cumulative = None, None  # logprobs=None: vLLM computes and returns none
        if sp.logprobs is not None:
            logprobs = [{t: Logprob(lp, rank=1)} for t, lp in zip(tokens, token_logprobs)]
            cumulative = sum(token_logprobs)
        prompt_logprobs = None
        if sp.prompt_logprobs is not None:
            prompt_logprobs = [None] + [{t: Logprob(-0.5 - 0.01 * j)} for j, t in enumerate(ids[1:], 1)]
        completion = types.SimpleNamespace(
            index=0,
            text="",
            token_ids=tokens,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
            finish_reason=reason,
            stop_reason=None,
        )
        return RequestOutput(
            request_id=str(index), prompt_token_ids=ids, prompt_logprobs=prompt_logprobs, outputs=[completion]
        )

    def _draw(self, ids: list[int], sp: SamplingParams) -> tuple[list[int], list[float]]:
        """No model: tokens from the request seed (greedy: from the prompt), made-up log-probs."""
        rng = random.Random(sp.seed) if sp.seed is not None else random
        tokens = []
        for step in range(sp.max_tokens):
            if sp.temperature == 0.0:
                tokens.append((sum(ids) + 7 * step) % self.vocab_size)
            else:
                tokens.append(rng.randrange(self.vocab_size))
            if tokens[-1] in sp.stop_token_ids:
                break
        return tokens, [-1.0 - 0.01 * j for j in range(len(tokens))]

    def _sample(self, ids: list[int], sp: SamplingParams) -> tuple[list[int], list[float]]:
        """vLLM 0.26's sampler on `logits_fn` (module docstring)."""
        gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else random.randrange(2**63))
        tokens, token_logprobs = [], []
        for _ in range(sp.max_tokens):
            with torch.no_grad():
                raw = LLM.logits_fn(ids + tokens).float()  # (vocab,)
            if sp.temperature < 1e-5:
                processed = raw
                token = int(raw.argmax())
            else:
                processed = _top_k_top_p(raw / sp.temperature, sp.top_k, sp.top_p)
                token = int(torch.multinomial(processed.softmax(-1), 1, generator=gen))
            chosen = raw if self.logprobs_mode == "raw_logprobs" else processed
            tokens.append(token)
            token_logprobs.append(float(chosen.log_softmax(-1)[token]))
            if token in sp.stop_token_ids:
                break
        return tokens, token_logprobs


def _tp_group() -> types.SimpleNamespace:
    """vllm.distributed.parallel_state.get_tp_group() of this rank: vLLM groups consecutive ranks of the
    whole world (external launcher) by the latest engine's tensor_parallel_size."""
    tp = LLM.instances[-1].kwargs.get("tensor_parallel_size", 1) if LLM.instances else 1
    first = dist.get_rank() // tp * tp
    return types.SimpleNamespace(ranks=list(range(first, first + tp)))


def install(
    monkeypatch,
    model_params: dict[str, torch.Tensor],
    logits_fn: Callable[[list[int]], torch.Tensor] | None = None,
) -> None:
    """Make `import vllm` (and the submodules the backend imports) return this fake for one test; `logits_fn`:
    the model its sampler runs on (module docstring)."""
    LLM.instances.clear()
    LLM.model_params = model_params
    monkeypatch.setattr(LLM, "logits_fn", staticmethod(logits_fn) if logits_fn else None)
    root = types.ModuleType("vllm")
    root.LLM, root.SamplingParams, root.__version__ = LLM, SamplingParams, "0.26.0"
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    distributed = types.ModuleType("vllm.distributed")
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_tp_group = _tp_group
    for name, module in {
        "vllm": root,
        "vllm.inputs": inputs,
        "vllm.distributed": distributed,
        "vllm.distributed.parallel_state": parallel_state,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
