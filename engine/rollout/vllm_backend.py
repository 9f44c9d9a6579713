"""`rollout.backend=vllm`: one vLLM engine per rollout-TP group, inside the torchrun job (SPMD).

Every rank builds an `LLM` with `distributed_executor_backend="external_launcher"`: vLLM then joins the
job's torch.distributed world (env:// from torchrun's RANK/LOCAL_RANK) instead of spawning workers, runs in
this process, and splits the world into TP groups of consecutive ranks ("ExternalDP x DP x PP x TP" in
vllm/distributed/parallel_state.py). The ranks of a vLLM TP group call `generate` with the same prompts
and seeds (they hold the same micro-DP share: engine/rollout_phase.py), so their schedules agree.

Weights: the engine starts from `load_format="dummy"` and, before each rollout, copies this rank's
rollout-layout shards into vLLM's parameters (engine/rollout/vllm_weights.py: shard by shard, no full
tensor anywhere). This needs vLLM's TP group to be our rollout TP group: true when rollout.tp equals
parallel.tp (consecutive ranks in both); when rollout.tp < parallel.tp the 3D-HybridEngine's rollout TP
groups are strided and `set_weights` refuses with the fix.

Memory: `enable_sleep_mode`; between rollouts the engine sleeps at level 2 (KV cache and weights released:
the weights are overwritten at every wake-up anyway, so level 1's copy of them to host memory is wasted),
and wakes up in two steps around the weight copy (weights, then KV cache) to keep the peak low. The prefix
cache is reset after each copy (cached blocks were computed with the old weights).

Sampling: each row (prompt, sample) is its own request, in row order. vLLM draws from the default CUDA
generator of this process, which `generate` seeds with SamplingParams.seed first: the same inputs and seed
give the same responses (vLLM's schedule is deterministic), and the ranks of a TP group draw the same tokens.
Per-request seeds (`per_request_seeds=True`: results independent of batch composition) make vLLM's sampler
loop over the requests in Python at every step, a large slowdown at hundreds of sequences. Log-probs:
`logprobs_mode="processed_logprobs"`, i.e. after temperature and, where top-k/top-p are set, over the
truncated distribution (vLLM renormalises there); without truncation this is the contract of
engine/rollout/base.py (full-vocabulary softmax(logits / T); T = 1 when greedy).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

from engine.models.builder import ModelShape
from engine.models.hf_config import hf_config_from_shape
from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, check_prompts, check_sampling
from engine.rollout.vllm_weights import load_rollout_weights
from parallel.rollout_weights import RolloutWeights

INSTALL_HINT = (
    "rollout.backend=vllm needs vLLM (0.26): pip install -e .[vllm] on a CUDA machine, "
    "or use rollout.backend=native"
)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


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


def row_seed(seed: int, row: int) -> int:
    """The vLLM request seed of output row `row` (distinct per row, reproducible per call)."""
    return (seed * 1_000_003 + row) % (2**63 - 1)


def _sampled_log_probs(completion) -> list[float]:
    """Log-prob of each generated token from a vLLM CompletionOutput requested with logprobs=0."""
    return [float(completion.logprobs[j][tok].logprob) for j, tok in enumerate(completion.token_ids)]


class VllmRollout(RolloutEngine):
    """vLLM behind the rollout interface (module docstring). Build it on every rank at the same time.

    `rollout_tp`: `rollout.tp` (vLLM's tensor_parallel_size). `model_dir`: a directory with the model's
    config.json (model.path), or None to write one from `shape`. `gpu_memory_utilization`, `max_num_seqs`:
    the `rollout.*` keys. `enforce_eager`: skip torch.compile and CUDA graphs (faster start, slower decode).
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
        per_request_seeds: bool = False,
    ):
        vllm = import_vllm()
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(
                f"rollout.backend=vllm runs on CUDA devices, not {device}; use rollout.backend=native"
            )
        self.shape, self.device, self.pad_id, self.rollout_tp = shape, device, pad_id, rollout_tp
        self.max_model_len = max_model_len or shape.max_position_embeddings
        self.sleep_level, self.per_request_seeds = sleep_level, per_request_seeds
        # external_launcher needs the engine core in this process (vLLM asserts it; set it rather than fail)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
            logprobs_mode="processed_logprobs",
        )
        self._vllm = vllm
        self.weights: RolloutWeights | None = None
        self.last_stats: dict[str, float] = {}
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
            self.llm.wake_up(tags=["weights"])
        w = self.weights
        stats = self.llm.apply_model(
            lambda model: load_rollout_weights(
                dict(model.named_parameters()), w.params, self.shape, w.tp_rank, w.tp_size, w.tp_group
            )
        )
        self.last_stats.update(stats[0])
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
        torch.cuda.synchronize(self.device)
        self.last_stats["wake_load_s"] = round(time.perf_counter() - start, 3)

    def release(self) -> None:
        """Sleep: free the KV cache and the weights' memory until the next generate."""
        if not self._asleep:
            start = time.perf_counter()
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            self.last_stats["sleep_s"] = round(time.perf_counter() - start, 3)

    def _requests(self, prompts: list[list[int]], sampling: SamplingParams):
        """(vLLM prompts, SamplingParams: one shared, or one per row with its own seed), in row order."""
        from vllm.inputs import TokensPrompt

        def params(seed: int | None):
            return self._vllm.SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,  # 0 = off in vLLM too
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=[] if sampling.ignore_eos else list(sampling.stop_token_ids),
                ignore_eos=True,  # stops are exactly stop_token_ids (no tokenizer, no implicit EOS)
                logprobs=0,
                seed=seed,
                detokenize=False,
            )

        inputs = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts for _ in range(sampling.n)]
        if not self.per_request_seeds:
            return inputs, params(None)
        return inputs, [params(row_seed(sampling.seed, r)) for r in range(len(inputs))]

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
        self.release()
        return [
            torch.tensor([float(out.prompt_logprobs[j][tok].logprob) for j, tok in enumerate(seq) if j > 0])
            for seq, out in zip(sequences, outputs)
        ]

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        if self.weights is None:
            raise RuntimeError("VllmRollout.generate called before set_weights()")
        check_sampling(sampling)
        new = sampling.max_new_tokens
        check_prompts(prompts, self.max_model_len - new, self.shape.vocab_size)
        rows = len(prompts) * sampling.n
        ids = torch.full((rows, new), self.pad_id, dtype=torch.long)
        log_probs = torch.zeros(rows, new)
        mask = torch.zeros(rows, new)
        reasons: list[str] = []
        if rows:
            self._wake_and_load()
            inputs, params = self._requests(prompts, sampling)
            torch.cuda.manual_seed(sampling.seed)  # vLLM samples from this process's default CUDA generator
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
            for r, out in enumerate(outputs):
                completion = out.outputs[0]
                n = len(completion.token_ids)
                ids[r, :n] = torch.tensor(completion.token_ids, dtype=torch.long)
                log_probs[r, :n] = torch.tensor(_sampled_log_probs(completion))
                mask[r, :n] = 1.0
                reasons.append("stop" if completion.finish_reason == "stop" else "length")
            self.release()
        return RolloutOutput(ids, mask, log_probs, reasons)
