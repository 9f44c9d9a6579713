"""`rollout.backend=vllm`: one vLLM engine per rollout-TP group, inside the torchrun job (SPMD).

Every rank builds an `LLM` with `distributed_executor_backend="external_launcher"`: vLLM then joins the
job's torch.distributed world (already initialised by parallel/state.py; vLLM reads RANK and takes
cuda:LOCAL_RANK as its device, so LOCAL_RANK is pointed at our device while it starts) instead of spawning
workers, runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), and splits the world into
TP groups of consecutive ranks ("ExternalDP x DP x PP x TP" in vllm/distributed/parallel_state.py). The
ranks of a vLLM TP group call `generate` with the same prompts and seeds (they hold the same micro-DP share:
engine/step/rollout.py), so their schedules agree. vLLM allows one engine per process (its sleep-mode
allocator) and reseeds Python's, numpy's and torch's global generators with `seed` when it starts.

Weights: the engine starts from `load_format="dummy"` and, before each rollout, copies this rank's
rollout-layout shards into vLLM's parameters (engine/rollout/vllm_weights.py: shard by shard, no full
tensor anywhere). This needs vLLM's TP group to be our rollout TP group: true when rollout.tp equals
parallel.tp (consecutive ranks in both); when rollout.tp < parallel.tp the 3D-HybridEngine's rollout TP
groups are strided and `set_weights` refuses with the fix.
MoE models start with `moe_backend="triton"`: the copy writes FusedMoE's expert tensors in the layout vLLM's
weight loader gives them, which only the Triton backend computes from (vLLM 0.26's automatic choice on Hopper;
elsewhere it would pick FlashInfer, whose weight post-processing swaps or block-shuffles w13 / w2).

Memory: `enable_sleep_mode`; between rollouts the engine sleeps at level 2 (KV cache and weights released:
the weights are overwritten at every wake-up anyway, so level 1's copy of them to host memory is wasted),
and wakes up in two steps around the weight copy (weights, then KV cache) to keep the peak low, after
returning PyTorch's cached blocks to the device (vLLM's allocator cannot use them). The prefix cache is reset
after each copy (cached blocks were computed with the old weights).

Sampling: each row (prompt, sample) is its own request, in row order, with its own seed (`row_seed`): the same
inputs and seed give the same responses, and the ranks of a TP group draw the same tokens. vLLM 0.26 runs
dense models on its V2 model runner, whose sampler draws Gumbel noise from (request seed, position) inside
one Triton kernel, so explicit seeds cost nothing there; a request without a seed would get one from numpy's
global generator (not reproducible per call), and the CUDA generator plays no part. (The V1 runner, still
used for some configurations, loops over seeded requests in Python at every step: slower, still reproducible.)
Log-probs: requested (`logprobs=0`: the sampled token's only) only when `SamplingParams.log_probs` is set,
since they cost vLLM a large share of its generation speed (measured in scripts/bench/README.md, "Rollout";
`scripts/bench/vllm_sampling_cost.py`); otherwise `logprobs=None` and `RolloutOutput.log_probs` is None.
The contract of engine/rollout/base.py is the full-vocabulary softmax(logits / T) (T = 1 when greedy). vLLM
0.26 offers two log-prob modes per engine (its V2 runner accepts only these two; vllm/v1/worker/gpu/sample/
sampler.py): "raw_logprobs", log_softmax of the model's logits before temperature, and "processed_logprobs",
log_softmax of the logits after temperature AND after top-k/top-p set the dropped tokens to -inf (so over the
truncated, renormalised distribution). Neither is the full distribution at T != 1 with top-k/top-p on, and the
sampled token's log-prob alone cannot be converted (that needs the dropped mass). `full_log_probs_mode` picks
the mode that gives the contract for the run's sampling settings: processed without truncation (or greedy:
vLLM turns top-k/top-p off and applies no temperature), raw with truncation at T = 1; it returns None for
truncation at T != 1, which engine/validate/ refuses while rollout.log_probs is on and `generate` refuses
for any request that asks for log-probs the engine's mode cannot give.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

from engine.models.builder import ModelShape, moe_config
from engine.models.hf_config import hf_config_from_shape, model_config_from_hf
from engine.rollout.base import (
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    check_limits_match,
    check_prompts,
    check_sampling,
)
from engine.rollout.vllm_weights import load_rollout_weights
from parallel.rollout_weights import RolloutWeights

INSTALL_HINT = (
    "rollout.backend=vllm needs vLLM (0.26): pip install -e .[vllm] on a CUDA machine, "
    "or use rollout.backend=native"
)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "vocab_size",
    "qkv_bias",
    "qk_norm",
    "tie_embeddings",
)
_MOE_ARCH_FIELDS = (
    "num_experts",
    "top_k",
    "ffn_hidden_size",
    "shared_expert_ffn_hidden_size",
    "shared_expert_gate",
    "norm_topk_prob",
)


def import_vllm():
    """The vllm module, or an ImportError that names the config key and the install command."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return vllm


def write_hf_config(shape: ModelShape, out_dir: str | None = None) -> str:
    """Write `hf_config_from_shape(shape)` (engine/models/hf_config.py, the same config the HF export writes)
    as `out_dir`/config.json (a fresh temp dir by default), for vLLM to build the model from."""
    out_dir = out_dir or tempfile.mkdtemp(prefix="rollout_vllm_")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_from_shape(shape), f, indent=2)
    return out_dir


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""
    return torch.cuda.mem_get_info(device)


def row_seed(seed: int, row: int) -> int:
    """The vLLM request seed of output row `row` (distinct per row, reproducible per call)."""
    return (seed * 1_000_003 + row) % (2**63 - 1)


def full_log_probs_mode(temperature: float, top_p: float, top_k: int) -> str | None:
    """vLLM's `logprobs_mode` whose log-probs are the full-vocabulary softmax(logits / temperature) for requests
    sampled this way (module docstring), or None where neither mode gives them (top-k/top-p at T != 1)."""
    if temperature == 0.0 or (top_p >= 1.0 and top_k <= 0):
        return "processed_logprobs"
    return "raw_logprobs" if temperature == 1.0 else None


def _gives_full_log_probs(mode: str, sampling: SamplingParams) -> bool:
    """Whether an engine in `mode` returns the contract's log-probs for `sampling` (module docstring)."""
    if mode == "raw_logprobs":  # before temperature: right at T = 1, and greedy (the contract's T = 1)
        return sampling.temperature in (0.0, 1.0)
    return full_log_probs_mode(sampling.temperature, sampling.top_p, sampling.top_k) == "processed_logprobs"


def _sampled_log_probs(completion) -> list[float]:
    """Log-prob of each generated token from a vLLM CompletionOutput requested with logprobs=0 (one
    {token id: Logprob} dict per generated token, the sampled token's entry always present)."""
    steps = completion.logprobs
    if steps is None or len(steps) != len(completion.token_ids):
        raise RuntimeError(
            f"vLLM returned {None if steps is None else len(steps)} log-prob entries for "
            f"{len(completion.token_ids)} generated tokens (SamplingParams.logprobs=0 was requested)"
        )
    return [float(steps[j][tok].logprob) for j, tok in enumerate(completion.token_ids)]


@contextlib.contextmanager
def _environ(**values: str):
    """Set environment variables for the duration of the block (restored after)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def check_vllm_model(shape: ModelShape, model_dir: str | None) -> None:
    """Refuse, before vLLM starts, a model vLLM would build differently from `shape`: a config.json in
    `model_dir` that describes another architecture (its experts included), or a Qwen2 head_dim other than
    hidden / heads (vLLM 0.26's Qwen2 attention derives head_dim that way and ignores the config's)."""
    if model_dir:
        theirs = model_config_from_hf(model_dir)
        diff = {k: (theirs[k], getattr(shape, k)) for k in _ARCH_FIELDS if theirs[k] != getattr(shape, k)}
        ours_moe = moe_config(shape.moe)
        for k in _MOE_ARCH_FIELDS:  # the experts vLLM's FusedMoE is built with
            if getattr(theirs["moe"], k) != getattr(ours_moe, k):
                diff[f"moe.{k}"] = (getattr(theirs["moe"], k), getattr(ours_moe, k))
        if diff:
            raise ValueError(
                f"{model_dir}/config.json (what vLLM builds) differs from the rollout model shape in "
                f"{', '.join(f'{k}: {a} vs {b}' for k, (a, b) in diff.items())}; point model.path at the "
                "checkpoint the actor was built from"
            )
    if shape.qkv_bias and shape.head_dim * shape.num_attention_heads != shape.hidden_size:
        raise ValueError(
            f"a Qwen2 model with head_dim={shape.head_dim} != hidden_size / num_attention_heads = "
            f"{shape.hidden_size} / {shape.num_attention_heads}: vLLM's Qwen2 attention ignores head_dim; "
            "use rollout.backend=native for this shape"
        )


class VllmRollout(RolloutEngine):
    """vLLM behind the rollout interface (module docstring). Build it on every rank at the same time, after
    torch.distributed is initialised (parallel/state.py).

    `rollout_tp`: `rollout.tp` (vLLM's tensor_parallel_size). `model_dir`: a directory with the model's
    config.json (model.path), or None to write one from `shape`. `gpu_memory_utilization`, `max_num_seqs`:
    the `rollout.*` keys. `enforce_eager`: skip torch.compile and CUDA graphs (faster start, slower decode;
    `rollout.cuda_graphs=false`). `logprobs_mode`: vLLM's, from `full_log_probs_mode` of the run's sampling.
    """

    def __init__(
        self,
        shape: ModelShape,
        device: torch.device,
        rollout_tp: int,
        pad_id: int = 0,
        *,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        seed: int = 0,
        model_dir: str | None = None,
        enforce_eager: bool = False,
        sleep_level: int = 2,
        logprobs_mode: str = "processed_logprobs",
    ):
        vllm = import_vllm()
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(
                f"rollout.backend=vllm runs on CUDA devices, not {device}; use rollout.backend=native"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "VllmRollout joins the job's torch.distributed world (vLLM's external launcher): call "
                "parallel.state.init_distributed first"
            )
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        check_vllm_model(shape, model_dir)
        self.shape, self.device, self.pad_id, self.rollout_tp = shape, device, pad_id, rollout_tp
        self.max_model_len = max_model_len or shape.max_position_embeddings
        self.sleep_level = sleep_level
        self.gpu_memory_utilization = gpu_memory_utilization
        self.logprobs_mode = logprobs_mode
        # external_launcher needs the engine core in this process (vLLM asserts it; set it rather than fail)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's worker takes cuda:LOCAL_RANK as its device; with one GPU per task (SLURM) that is not ours
        with _environ(LOCAL_RANK=str(device.index), RANK=str(dist.get_rank())):
            self.llm = vllm.LLM(
                model=model_dir or write_hf_config(shape),
                skip_tokenizer_init=True,
                load_format="dummy",
                dtype=_DTYPE_NAMES[shape.dtype],
                tensor_parallel_size=rollout_tp,
                distributed_executor_backend="external_launcher",
                gpu_memory_utilization=gpu_memory_utilization,
                max_num_seqs=max_num_seqs,
                max_model_len=self.max_model_len,
                enable_sleep_mode=True,
                enforce_eager=enforce_eager,
                seed=seed,
                logprobs_mode=logprobs_mode,
                enable_prefix_caching=True,  # multi-turn turns share their episode's prefix
                **({"moe_backend": "triton"} if shape.moe else {}),  # the expert layout the loader writes
            )
        self._vllm = vllm
        self.uses_v2_model_runner = bool(self.llm.llm_engine.vllm_config.use_v2_model_runner)
        self.weights: RolloutWeights | None = None
        self.last_stats: dict[str, float] = {}
        self._holding = False
        """Inside `hold()`: generate leaves the engine awake."""
        self._held_loaded = False
        """Inside `hold()`: the weights are loaded and the engine awake."""
        self.llm.sleep(level=sleep_level)
        self._asleep = True

    def _check_groups(self, weights: RolloutWeights) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        ours = (
            dist.get_process_group_ranks(weights.tp_group)
            if weights.tp_group is not None
            else [dist.get_rank()]
        )
        theirs = list(get_tp_group().ranks)
        if ours != theirs:
            raise ValueError(
                f"vLLM's TP group on rank {dist.get_rank()} is {theirs} (consecutive ranks) but the rollout TP group "
                f"is {ours}: rollout.backend=vllm needs rollout.tp == parallel.tp or rollout.tp=1; set one of "
                "those or use rollout.backend=native"
            )

    def set_weights(self, weights: RolloutWeights) -> None:
        if weights.tp_size != self.rollout_tp or weights.pp_size != 1:
            raise ValueError(
                f"the vLLM engine was built for rollout.tp={self.rollout_tp}, rollout.pp=1 but the weights have "
                f"tp={weights.tp_size}, pp={weights.pp_size}"
            )
        self._check_groups(weights)
        self.weights = weights

    def _wake_and_load(self) -> None:
        start = time.perf_counter()
        if self._asleep:
            # vLLM maps its weights and KV cache through its own allocator (cumem): blocks that PyTorch's caching
            # allocator keeps from the training phases are not free to it (without this, 1.5B GRPO on one H200
            # with rollout.gpu_memory_utilization=0.5: wake_up(kv_cache) ran out of memory)
            torch.cuda.empty_cache()
            self._wake("weights")
        w = self.weights
        stats = self.llm.apply_model(
            lambda model: load_rollout_weights(
                dict(model.named_parameters()), w.params, self.shape, w.tp_rank, w.tp_size, w.tp_group
            )
        )
        self.last_stats.update(stats[0])
        if self._asleep:
            self._wake("kv_cache")
            self._asleep = False
        if self.llm.llm_engine.is_sleeping():  # a paused scheduler would make generate() spin forever
            raise RuntimeError("vLLM still reports sleeping after wake_up(weights) + wake_up(kv_cache)")
        self.llm.reset_prefix_cache()
        torch.cuda.synchronize(self.device)
        self.last_stats["wake_load_s"] = round(time.perf_counter() - start, 3)

    def _wake(self, tag: str) -> None:
        """vLLM's wake_up of one tag; running out of device memory there becomes an error with the numbers and
        the keys that fix it (vLLM's own is a bare CUDA out-of-memory from its allocator)."""
        try:
            self.llm.wake_up(tags=[tag])
        except RuntimeError as err:
            if "out of memory" not in str(err):
                raise
            free, total = device_memory(self.device)
            util = self.gpu_memory_utilization
            raise RuntimeError(
                f"vLLM ran out of memory mapping its {tag} on {self.device}: {free / 2**30:.1f} of "
                f"{total / 2**30:.1f} GiB free with the training state resident, and "
                f"rollout.gpu_memory_utilization={util} lets vLLM map up to {util * total / 2**30:.1f} GiB. Lower "
                "rollout.gpu_memory_utilization (vLLM checks it only against the memory free when it starts, "
                "before the first optimizer step creates Adam's moments), set trainer.offload_optimizer=true, "
                "or use rollout.backend=native"
            ) from err

    def release(self) -> None:
        """Sleep: free the KV cache and the weights' memory until the next generate."""
        if not self._asleep:
            start = time.perf_counter()
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            self.last_stats["sleep_s"] = round(time.perf_counter() - start, 3)

    def _requests(self, prompts: list[list[int]], sampling: SamplingParams):
        """(vLLM prompts, one SamplingParams per row with the row's seed), in row order."""
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts for _ in range(sampling.n)]
        params = [
            self._vllm.SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,  # 0 = off in vLLM too (-1 is accepted as well)
                max_tokens=sampling.limit_of(r // sampling.n),
                stop_token_ids=[] if sampling.ignore_eos else list(sampling.stop_token_ids),
                ignore_eos=True,  # stops are exactly stop_token_ids (engine/data.py stop_token_ids)
                logprobs=0 if sampling.log_probs else None,  # 0: the sampled token's log-prob only
                seed=row_seed(sampling.seed, r),
                detokenize=False,
            )
            for r in range(len(inputs))
        ]
        return inputs, params

    def sequence_log_probs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """vLLM's log-prob of every token but the first of each sequence (teacher forcing, temperature 1), for
        parity checks against the training forward: (len - 1,) float32 per sequence."""
        from vllm.inputs import TokensPrompt

        if self.weights is None:
            raise RuntimeError("VllmRollout.sequence_log_probs called before set_weights()")
        self._wake_and_load()
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False
        )
        result = [
            torch.tensor([float(out.prompt_logprobs[j][tok].logprob) for j, tok in enumerate(seq) if j > 0])
            for seq, out in zip(sequences, outputs)
        ]
        del outputs  # before vLLM's sleep and its gc.collect() (generate)
        self.release()
        return result

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        if self.weights is None:
            raise RuntimeError("VllmRollout.generate called before set_weights()")
        check_sampling(sampling)
        check_limits_match(prompts, sampling)
        if sampling.log_probs and not _gives_full_log_probs(self.logprobs_mode, sampling):
            raise ValueError(
                f"vLLM with logprobs_mode={self.logprobs_mode} cannot return log-probs of the full distribution at "
                f"temperature={sampling.temperature} with top_p={sampling.top_p}, top_k={sampling.top_k} (raw: "
                "before temperature; processed: over the top-p/top-k truncated distribution). Fix: "
                "rollout.temperature=1.0, or rollout.top_p=1.0 and rollout.top_k=0, or rollout.log_probs=false, "
                "or rollout.backend=native"
            )
        new = sampling.max_new_tokens
        check_prompts(prompts, self.max_model_len - new, self.shape.vocab_size)
        rows = len(prompts) * sampling.n
        ids = torch.full((rows, new), self.pad_id, dtype=torch.long)
        log_probs = torch.zeros(rows, new) if sampling.log_probs else None
        mask = torch.zeros(rows, new)
        reasons: list[str] = []
        if rows:
            if not self._held_loaded:
                self._wake_and_load()
                self._held_loaded = self._holding
            reasons = self._generate_into(prompts, sampling, ids, log_probs, mask)
            # vLLM's sleep runs gc.collect(): its outputs (with log-probs one dict and one Logprob object per token)
            # are dropped by now, so the collection does not walk them
            if not self._holding:
                self.release()
        return RolloutOutput(ids, mask, log_probs, reasons)

    @contextlib.contextmanager
    def hold(self, max_len: int | None = None):
        """Stay awake across the `generate` calls inside (weights loaded once, prefix cache kept: the turns of
        multi-turn episodes reuse their earlier turns' KV blocks); sleep on exit. `max_len` is not needed."""
        self._holding, self._held_loaded = True, False
        try:
            yield
        finally:
            self._holding, self._held_loaded = False, False
            self.release()

    def _generate_into(self, prompts, sampling: SamplingParams, ids, log_probs, mask) -> list[str]:
        """Run vLLM on the rows and copy its outputs into the (rows, new) tensors; the finish reasons."""
        inputs, params = self._requests(prompts, sampling)
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        if len(outputs) != len(inputs):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(inputs)} requests")
        reasons = []
        for r, out in enumerate(outputs):
            completion = out.outputs[0]
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished row {r} with reason {completion.finish_reason!r}")
            n = len(completion.token_ids)
            ids[r, :n] = torch.tensor(list(completion.token_ids), dtype=torch.long)
            if log_probs is not None:
                log_probs[r, :n] = torch.tensor(_sampled_log_probs(completion))
            mask[r, :n] = 1.0
            reasons.append(completion.finish_reason)
        return reasons
