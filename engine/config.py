"""The typed configuration: one dataclass per group, registered with Hydra's ConfigStore, and the few values
derived from it that several modules need (`max_response_tokens`, ...; micro-batch sizes: micro_batch_sizing).

YAML under conf/ holds values only; every key a user can set is declared here with a one-line docstring.
engine/config_load.py turns the composed config into a `TrainConfig`; engine/validate/ checks it and raises
`ConfigError`, whose message names the key(s), the value, the rule and a fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from engine.errors import UserError

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TrainerConfig:
    total_steps: int = 60
    """Number of RL steps (rollout + update) to run."""
    seed: int = 1
    """Seed for model init, data order and sampling."""
    output_dir: str = ""
    """Where metrics.jsonl and checkpoints go; empty = Hydra's run directory."""
    save_freq: int = 0
    """Save a checkpoint every N steps and after the last step (0 = never)."""
    max_checkpoints: int = 2
    """Keep the newest N checkpoints in output_dir/checkpoints (0 = keep all)."""
    test_freq: int = 0
    """Validate every N steps and after the last one (0 = never)."""
    val_before_train: bool = False
    """Also validate the starting model, before the first step of a fresh run, logged as step 0 (verl's
    `trainer.val_before_train`, on by default there); colocated placement only."""
    resume: str = "off"
    """`auto` (latest usable checkpoint in output_dir, else start fresh), `off`, or a checkpoint path. A path
    to a checkpoint of this output_dir older than its latest (a branch off that run's history) is refused
    unless trainer.overwrite=true; a branch into a new output_dir keeps both histories."""
    overwrite: bool = False
    """Let a fresh run (resume=off, or resume=auto finding no usable checkpoint) start in an output_dir that
    holds an earlier run's metrics.jsonl or checkpoints: they (and tensorboard/, hf_actor/, profile/) are removed
    first; and let resume=PATH branch from an older checkpoint of this output_dir: the checkpoints after it
    are deleted and `latest` names it before the first step (metrics.jsonl keeps lines up to its step)."""
    export_hf: bool = False
    """After the last step, write the actor as a Hugging Face checkpoint to output_dir/hf_actor."""
    offload_reference: bool = False
    """Keep the reference policy's weights in host memory except while it computes log-probs."""
    offload_optimizer: bool = False
    """Keep the actor's optimizer state in host memory except during its update."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Any of console, jsonl, tensorboard, wandb."""
    micro_batch_size: int | None = None
    """Rows per micro-batch on each DP rank (packed: as many tokens at the batch's longest row), capped by
    memory (engine/roles/memory_cap.py). Empty (null): 8, and at pp=1, packed, without a budget, at least
    32,768 tokens where the memory holds them (engine/micro_batch_sizing.py)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of a micro-batch (0 = off): rows sorted by length are grouped under it, each micro-batch
    packed (pack_sequences) or padded only to its own longest row; replaces micro_batch_size. Must fit the
    longest sequence."""
    pack_sequences: bool | None = None
    """Lay each micro-batch's rows back to back in one sequence (no padding; a token budget counts real
    tokens) instead of padding them: to the batch's longest row with micro_batch_size rows, to the
    micro-batch's own longest with a token budget. Empty (null) = on (the padded layout computes the padding:
    at long-tailed lengths most of the update)."""
    balance_batch: bool = True
    """Over DP replicas, re-deal the step's prompt groups so that each holds near the same tokens in every
    mini-batch (verl's key; engine/step/balance.py): the same update up to summation order, less waiting."""
    share_prompts: bool | None = None
    """Each group's prompt once per packed micro-batch, its responses attending to it (roles/shared_prompts.py):
    the same results, fewer tokens. Empty (null) = on where it runs, rollout.n > 1, no layers' CUDA graphs."""
    progress_bar: bool = True
    """Show a progress bar on the logging rank."""
    plot: bool = True
    """At the end of the run, draw metrics.jsonl into output_dir/metrics.png (`python -m engine.plot`; needs
    matplotlib and the jsonl logger, and says so in one line when either is missing)."""
    off_policy_steps: int = 0
    """placement.mode=split: how many steps the rollout may run ahead of the update (0 = on-policy, the same
    results as colocated)."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps (from 1) to run, slower, under torch.profiler: traces in output_dir/profile/, `perf/gpu_busy/<phase>`
    on CUDA (engine/step_profiler.py; split placement's rollout ranks send theirs for `gen` and `reward`)."""
    cuda_graphs: bool | None = None
    """The transformer layers' forward and backward from CUDA graphs (engine/models/layer_graphs.py): no host
    launch time for small micro-batches. Needs CUDA, pp=1, tp=1, no recompute or MoE, half precision if packed
    (true is refused otherwise). Empty (null) = on where that holds in bfloat16 without a token budget."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size of the training layout."""
    pp: int = 1
    """Pipeline-parallel size of the training layout."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (interleaved 1F1B when > 1)."""
    sp: bool = False
    """Sequence parallelism inside TP groups."""
    first_stage_layers: int = 0
    """Transformer layers of the first pipeline stage (0 = automatic: parallel/stage_layers.py stage_layer_counts)."""
    last_stage_layers: int = 0
    """Transformer layers of the last pipeline stage (0 = automatic); the middle stages share the rest equally."""
    ep: int = 1
    """Expert-parallel size (MoE models): the routed experts of every MoE layer are split over `ep` ranks of
    the data-parallel axis (tokens travel to their experts by all-to-all); must divide model.moe.num_experts
    and the data-parallel size. Experts are not tensor-parallel (megatron's expert TP size is 1)."""


@dataclass
class MultiTurnConfig:
    """Episodes of several assistant turns with tool calls between them (engine/multi_turn/)."""

    enable: bool = False
    """Roll out episodes: after an assistant turn with tool calls, run the tools, append their results as a
    tool turn and let the model continue (rollout.max_new_tokens is then the limit of one assistant turn)."""
    max_turns: int = 4
    """Most assistant turns per episode."""
    max_total_tokens: int = 128
    """Most tokens of an episode after its prompt (assistant and tool turns); data.max_prompt_len +
    max_total_tokens + rollout.max_new_tokens must fit model.max_position_embeddings."""
    tool_format: str = "hermes"
    """How tool calls are written (engine/multi_turn/parsers.py): `hermes` (<tool_call>{json}</tool_call>) or
    `compact` (`#<argument>`, for the embedded character-level tokenizer)."""
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """Tools of every episode: built-in names (`calculator`, `python`) or `module:function`; a data row's
    `tools` column picks a subset by name."""
    tool_timeout_s: float = 10.0
    """Wall-clock seconds one tool call may take; a slower call becomes an error message in the episode."""
    sandbox_memory_mb: int = 512
    """Address-space limit of the `python` tool's process."""
    max_tool_result_chars: int = 512
    """Tool results longer than this are cut before they are rendered: their start and end kept around a marker
    that counts the cut characters (engine/multi_turn/episode.py `cut_tool_result`)."""


@dataclass
class RolloutConfig:
    backend: str = "native"
    """`native` (KV-cache engine on the rollout-layout weights) or `vllm`."""
    tp: int = 1
    """Tensor-parallel size of the rollout layout; must divide parallel.tp (placement.mode=split: must divide
    placement.rollout_ranks, the rollout DP size being their quotient)."""
    weight_sync: str = "hybrid"
    """`hybrid` (3D-HybridEngine, in place) or `naive` (every rank gathers the full model; a baseline)."""
    keep_rollout_weights: bool = False
    """Keep the gathered rollout weights between steps (faster transitions, more memory)."""
    n: int = 8
    """Responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (>= 0.01, engine/rollout/base.py `MIN_TEMPERATURE`)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = 8
    """Most tokens generated per response."""
    log_probs: bool = True
    """Return each sampled token's log-prob from the rollout. Needed by algorithm.tis_cap > 0 (engine/validate/
    refuses false then); a KL in the reward without them runs the old-log-prob forward instead
    (`needs_old_log_prob_forward`); otherwise they only feed actor/rollout_kl and rollout/logprob_mean. vLLM
    pays for them in throughput (scripts/bench/README.md); the native engine computes them anyway."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks fix response lengths this way)."""
    val_temperature: float = 0.0
    """Temperature of validation responses (0 = greedy, else >= 0.01), as verl's val_kwargs.temperature."""
    val_top_p: float = 1.0
    """Nucleus mass of sampled validation responses (val_temperature > 0), as verl's val_kwargs.top_p."""
    val_top_k: int = 0
    """Top-k of sampled validation responses (val_temperature > 0; 0 = off), as verl's val_kwargs.top_k."""
    val_n: int = 1
    """Validation: besides the one val_temperature response, k > 1 responses per prompt, logged as
    val/<data_source>/mean@k, best@k and maj@k: sampled at val_temperature, val_top_p and val_top_k (verl's
    val_kwargs with n = k), or, with val_temperature = 0 (k greedy responses would all be one), at training's
    temperature, top_p and top_k."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory for weights + KV cache."""
    max_num_seqs: int = 256
    """vLLM / native: most sequences decoded at once."""
    cuda_graphs: bool = True
    """Replay captured decode steps (CUDA graphs); false = eager decode (vLLM: enforce_eager, which also skips
    torch.compile: a faster start, a slower rollout). The native engine decodes eagerly either way where its
    step syncs with the host: MoE models whose experts cannot run as grouped GEMMs (float32, or off sm90/sm100)."""
    kv_cache_memory_fraction: float = 0.5
    """native on CUDA: fraction of free GPU memory for the KV cache (batches that do not fit are chunked)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn episodes with tool calls (off by default)."""


@dataclass
class DataConfig:
    train_files: Any = field(default_factory=list)
    """Parquet files in the RLHF schema: one path or a list (`~` expands); empty = the embedded task."""
    val_files: Any = field(default_factory=list)
    """Parquet files for validation, as train_files; empty = a held-out embedded set when training on it.
    Every prompt is scored once at any DP size (a replica short of one runs a repeat it does not count)."""
    batch_size: int = 16
    """Prompts per step (global, across DP ranks). An epoch is the whole batches of the prompts: when
    data.batch_size does not divide their number, each epoch leaves the remainder out (as verl's drop_last),
    other prompts each epoch when shuffling, the same last ones without (said at the start)."""
    max_prompt_len: int = 64
    """Prompts longer than this many tokens are dropped (and counted)."""
    bad_rows: str = "error"
    """`error` or `skip` rows with a missing or malformed field."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded)."""
    embedded_task: str = "copy"
    """Embedded task when train_files is empty: `copy`, `target` or `calculator` (a multi-turn task: needs
    rollout.multi_turn.enable, tool_format=compact and the calculator tool)."""
    embedded_digits: int = 4
    """Digits per embedded prompt (the response length the task asks for)."""


@dataclass
class MoEConfig:
    """Mixture-of-experts MLPs (megatron-core's MoELayer) in every transformer layer; off when num_experts=0."""

    num_experts: int = 0
    """Routed experts per layer; 0 = a dense SwiGLU MLP (model.ffn_hidden_size)."""
    top_k: int = 2
    """Experts each token is routed to."""
    ffn_hidden_size: int = 0
    """SwiGLU inner width of one routed expert (Hugging Face `moe_intermediate_size`); 0 = model.ffn_hidden_size."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of the shared expert every token passes through (Qwen2-MoE); 0 = no shared expert."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(a learned per-token gate), as Qwen2-MoE does."""
    score_function: str = "softmax"
    """Router scores: `softmax` (Qwen2/Qwen3-MoE, Mixtral, OLMoE) or `sigmoid` (DeepSeek-V3 style)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k weights of a token to sum to 1 (Qwen3-MoE: true; Qwen2-MoE, OLMoE: false).
    score_function=sigmoid always renormalises (megatron's router)."""
    aux_loss_coef: float | None = None
    """Load-balancing auxiliary loss coefficient (megatron's `aux_loss`, Switch-Transformer style; 0 = off).
    None: with model.path, its config.json's `router_aux_loss_coef` (0 where it has none), as verl reads it;
    without model.path, 0. A number is used as it is, with or without model.path (a training setting, not the
    architecture: RL runs often turn the load-balancing loss off on a checkpoint trained with it)."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE; 0 = off)."""
    token_dispatcher: str = "alltoall"
    """How tokens reach experts on other ranks: `alltoall` or `allgather` (megatron's dispatchers)."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Preset name, for logs."""
    path: str = ""
    """Local Hugging Face checkpoint directory; empty = random init from the fields below."""
    tokenizer_path: str = ""
    """Tokenizer directory; empty = model.path, or the embedded tokenizer for random init."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 192
    """SwiGLU inner width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups)."""
    head_dim: int = 0
    """Per-head width; 0 = hidden_size / num_attention_heads."""
    vocab_size: int = 0
    """Vocabulary (random init; at least the tokenizer's size); 0 = the tokenizer's size."""
    max_position_embeddings: int = 256
    """Longest prompt + response."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling_factor: float = 0.0
    """Llama-3 ('llama3' type) RoPE frequency scaling factor, as in megatron's GPTModel; 0 = no scaling."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qkv_bias: bool = False
    """Bias on the fused QKV projection (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys (Qwen3)."""
    tie_embeddings: bool = False
    """Output layer shares the input embedding."""
    init_std: float = 0.02
    """Std of the random init."""
    dtype: str = "float32"
    """Parameter dtype for compute: float32, bfloat16 or float16."""
    recompute: bool = False
    """Full activation recompute of every layer."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts MLPs (off by default)."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate of the actor."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    lr_warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    lr_decay: str = "constant"
    """`constant`, `linear` or `cosine` after warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 = off)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP ranks (megatron's distributed optimizer)."""
    initial_loss_scale: float = 65536.0
    """model.dtype=float16: the dynamic loss scale to start from (halved after overflows, which skip the step)."""


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    """Preset name, for logs."""
    adv_estimator: str = "grpo"
    """A registered advantage estimator (algorithms/advantages.py), e.g. grpo or gae (PPO, with a critic)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (false = Dr.GRPO)."""
    gamma: float = 1.0
    """Discount (gae, reinforce_pp)."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    policy_loss: str = "ppo"
    """A registered policy loss (algorithms/losses.py): ppo or gspo."""
    clip_ratio_low: float = 0.2
    """Lower clip range of the ratio."""
    clip_ratio_high: float = 0.2
    """Upper clip range of the ratio (clip-higher when larger)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    kl_loss_coef: float = 0.0
    """Coefficient of KL(actor || reference) as a loss term (0 = off)."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 | abs, for both the KL loss and the KL in the reward."""
    kl_in_reward: bool = False
    """Subtract kl_reward_coef * KL(actor || reference) from every response token's reward."""
    kl_reward_coef: float = 0.0
    """Initial coefficient of the KL penalty in the reward (needs kl_in_reward)."""
    kl_ctrl: str = "fixed"
    """fixed | adaptive controller for the KL-in-reward coefficient."""
    kl_target: float = 0.1
    """Adaptive controller's KL target."""
    kl_horizon: int = 10000
    """Adaptive controller's horizon."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    value_clip: float = 0.2
    """Critic value clipping range (gae; 0 = off, where verl's cliprange_value=0 would pin the old values)."""
    tis_cap: float = 0.0
    """Truncated importance-sampling cap between rollout and training log-probs (0 = off)."""
    tis_mode: str = "truncate"
    """With tis_cap > 0: truncate (TIS: weight min(w, cap)) | mask (weight w, tokens with w > cap dropped)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill the batch with more prompts."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: most rollout rounds per step (the first included); when hit, the batch is completed
    with dropped groups (logged as dynamic_sampling/filler_groups)."""
    overlong_buffer_len: int = 0
    """DAPO: soft overlong penalty over the last N of rollout.max_new_tokens tokens (0 = off; <= max_new_tokens);
    multi-turn: of the episode's rollout.multi_turn.max_total_tokens (`max_response_tokens`)."""
    overlong_buffer_frac: float = 0.0
    """DAPO: the overlong buffer as a fraction of rollout.max_new_tokens (rounded down, at least 1 token), used
    when overlong_buffer_len is 0 (0 = off)."""
    overlong_penalty: float = 1.0
    """DAPO: penalty factor at max length."""
    ppo_epochs: int = 1
    """Passes over each step's batch (actor and critic)."""
    num_mini_batches: int = 1
    """Optimizer steps per epoch (actor and critic)."""
    router_replay: bool = False
    """MoE: the actor's training forwards reuse the experts the rollout's routers chose for every prompt and
    response token (engine/roles/router_replay.py); needs model.moe and rollout.backend=native."""


@dataclass
class CriticConfig:
    """The value model of PPO (algorithm.adv_estimator=gae): same architecture and layout as the actor with a
    scalar value head; other optimizer settings (betas, decay, clipping) are optim's."""

    path: str = ""
    """Hugging Face checkpoint of the critic's backbone (+ score.weight if present); empty = model.path."""
    lr: float = 1e-3
    """Peak learning rate of the critic (critics often use ~10x the actor's optim.lr)."""
    lr_warmup_steps: int = 0
    """Linear warm-up optimizer steps of the critic."""


@dataclass
class RewardConfig:
    fn: str = ""
    """User reward `module:function` or `path/to/file.py:function`; empty = built-in by data_source."""
    model_path: str = ""
    """Local HF reward model (*ForSequenceClassification/*ForTokenClassification, num_labels=1, the actor's
    tokenizer), frozen in the actor's layout, scored at the last token of prompt + response; empty = none."""
    combine: str = "model"
    """With model_path: `model` (the model's score alone; reward.fn must be empty) or `sum` (model score +
    the reward.fn / built-in rule score)."""
    gsm8k_method: str = "strict"
    """How the built-in GSM8K rule reads answers: `strict` / `flexible` (verl's gsm8k.compute_score methods,
    string equality) or `numeric` (the number after the last `####`, compared as a number)."""
    timeout_s: float = 300.0
    """Seconds reward.fn may take for one batch of responses before the run stops with the function's name
    and the response it was on; reward.fn then runs in a child process per rank. 0 = no limit (in process)."""


@dataclass
class ClusterConfig:
    name: str = "cpu"
    """Preset name, for logs."""
    device: str = "cpu"
    """`cpu` (gloo) or `cuda` (NCCL, one GPU per rank)."""
    timeout_s: float = 600.0
    """Seconds a collective (default and megatron groups) waits; a dead or stuck rank fails the others after it."""
    peak_tflops: float = 989.0
    """Peak dense TFLOP/s of one accelerator, for perf/mfu/actor (989 = H100/H200 bf16); unused on CPU."""


@dataclass
class PlacementConfig:
    """Which ranks train and which generate (DESIGN.md, Placement)."""

    mode: str = "colocated"
    """`colocated` (every rank trains and generates) or `split` (the last placement.rollout_ranks ranks
    generate, the others train)."""
    rollout_ranks: int = 0
    """split: ranks that only generate (the last ones); their layout is rollout.tp x (rollout_ranks / rollout.tp)
    replicas."""
    critic_ranks: int = 0
    """split with a critic (algorithm.adv_estimator=gae): ranks of their own for the critic, before the rollout
    ranks (0 = the critic shares the actor's ranks)."""
    critic_tp: int = 0
    """Tensor-parallel size of the critic on its own ranks (placement.critic_ranks > 0); 0 = parallel.tp."""
    critic_pp: int = 0
    """Pipeline-parallel size of the critic on its own ranks; 0 = parallel.pp. The critic's DP size
    (critic_ranks / (critic_tp x critic_pp)) must equal the actor's: critic replica d serves actor replica d."""


@dataclass
class TrainConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def register_configs() -> None:
    """Register the schema so conf/train.yaml composes onto typed nodes (typos in keys fail at compose)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)


class ConfigError(UserError, ValueError):
    """A configuration value or combination that cannot work; the message says which key and how to fix it."""

    exit_status = 2
