"""Baseline for scripts/bench/e2e.py: verl 0.9.1's GRPO (FSDP actor, vLLM rollout colocated, its GSM8K GRPO
example's settings adapted to the workload) on the same random-init architecture, batch, group size and
response lengths. Prints one JSON line: per-step seconds and tokens/s/GPU. verl runs from the venv that
scripts/bench/install_verl_on_gpu.sh builds (`--python`); this script itself does not import verl.

    python scripts/bench/verl_grpo.py --preset qwen2_5_0_5b --lengths long_tail --response-len 1024
    python scripts/bench/verl_grpo.py --preset tiny --prepare-only --workdir /tmp/v   # the files only (CPU)

What it writes under `--workdir` (a new temporary folder by default):
- `model/`: random-init weights of the `conf/model` preset (Qwen2 architecture, bf16) and the embedded
  character-level tokenizer (engine/tasks/embedded.py) with a chat template that is BOS + the message
  contents, so a prompt of `--prompt-len` - 1 digits is exactly `--prompt-len` tokens after verl applies it.
- `train.parquet`: verl's RLHFDataset rows, one per prompt: `prompt` [{"role": "user", "content": digits}]
  (trl_grpo.bench_prompts: the TRL baseline's prompts), `data_source`, `reward_model` {"ground_truth": ""},
  `extra_info` {"index": i, "max_tokens": cap}, cap = workload.response_lengths(...)[i].
- `reward.py`: `compute_score` returning 0.0 (rewards do not change the cost).
- `agent_loops.yaml`: registers `verl_capped_agent_loop.CappedSingleTurnAgentLoop` (this folder), verl's
  single-turn agent loop with `max_tokens` = the row's cap in its request's sampling params (verl 0.9.1's vLLM
  server takes a per-request `max_tokens`); with `rollout.ignore_eos=true` every response is exactly its cap.

verl settings (GSM8K GRPO example, run_qwen2-7b.sh, adapted): adv_estimator grpo, lr 1e-6, no KL loss or KL
reward (beta 0, like ours and TRL), entropy 0, ppo_mini_batch_size = `--prompts` (one optimizer step per
step), one PPO epoch, dynamic batch size with `--max-tokens` tokens per micro-batch (default 16384: 32768
ran out of memory in the update at 0.5B on an H200), rollout TP 1, the legacy trainer (`trainer.use_v1=false`:
verl 0.9.1's V1 trainer needs TransferQueue, not carried),
`gpu_memory_utilization` `--gpu-memory-utilization` (example 0.6), n = `--n`, no validation, no checkpoints,
console logger. Attention: SDPA (flash-attn is not installed; verl's default is flash_attention_2), and
`use_remove_padding` only with `--remove-padding` (without flash-attn, transformers' SDPA masks the packed
rows as one block-diagonal sequence: correct, but attention over the whole packed micro-batch).

Timing: verl's console logger prints `step:N - key:value - ...` per step (after Ray's `(TaskRunner pid=N)`
prefix); `timing_s/step` of steps after the first gives `step_s` (median; None with one step: the first is
`first_step_s`), the other `timing_s/*` keys (gen, old_log_prob, update_actor, update_weights, ...) are
reported per step, with `perf/mfu/actor` and the actor's `max_memory_allocated_gb`. Tokens/s/GPU count real
tokens: n x sum(prompt_len + cap). On SIGTERM (run.sh's `timeout`) the JSON of the steps logged so far is
printed (`stopped_by_signal`) and verl is killed: keep run.sh's `--timeout` below the device call's limit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from trl_grpo import bench_prompts  # noqa: E402
from workload import add_step_args, describe, response_lengths  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VENV_PYTHON = "/root/verl-venv/bin/python"
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
AGENT_LOOP = "capped_single_turn"
REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Constant reward: the benchmark measures cost, not learning."""
    return 0.0
'''
# verl 0.9.1 logs from a Ray actor: the line starts with a colored `(TaskRunner pid=N)` prefix
STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
METRIC = re.compile(r"([\w/@.\-]+):(?:np\.\w+\()?(-?[\d.]+(?:[eE][-+]?\d+)?|nan|inf)\)?")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_0_5b")
    add_step_args(ap)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=16384,
        help="ppo_max_token_len_per_gpu (dynamic bsz); 32768 ran out of memory on an H200 at 0.5B (151,936 vocab: "
        "verl's log-softmax takes fp32 logits of the whole micro-batch)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument(
        "--remove-padding", action="store_true", help="actor_rollout_ref.model.use_remove_padding"
    )
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--workdir", default=None, help="where the model, data and config files go")
    ap.add_argument("--prepare-only", action="store_true", help="write the files, print their summary, stop")
    ap.add_argument("--python", default=None, help=f"verl's interpreter (default {VENV_PYTHON} if present)")
    return ap.parse_args(argv)


def prepare(args: argparse.Namespace, workdir: str, device: str = "cpu") -> dict:
    """Write the model, tokenizer, dataset, reward and agent-loop files under `workdir`; return their paths
    and the workload (prompts, caps)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from presets import hf_config_for
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.data import load_tokenizer
    from engine.tasks.embedded import build_embedded_tokenizer

    model_dir = os.path.join(workdir, "model")
    tokenizer = load_tokenizer(build_embedded_tokenizer(os.path.join(workdir, "tok")))
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU there: minutes on the CPU at 7B
        model = Qwen2ForCausalLM(Qwen2Config(**hf_config_for(args.preset))).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model

    prompts = bench_prompts(args.prompts, args.prompt_len, args.seed)
    caps = response_lengths(args.lengths, args.prompts, args.response_len, args.seed)
    rows = {
        "data_source": ["bench/long_tail" if args.lengths != "fixed" else "bench/fixed"] * args.prompts,
        "prompt": [[{"role": "user", "content": p}] for p in prompts],
        "ability": ["bench"] * args.prompts,
        "reward_model": [{"style": "rule", "ground_truth": ""} for _ in prompts],
        "extra_info": [{"index": i, "max_tokens": int(c)} for i, c in enumerate(caps)],
    }
    data = os.path.join(workdir, "train.parquet")
    pq.write_table(pa.table(rows), data)
    reward = os.path.join(workdir, "reward.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    loops = os.path.join(workdir, "agent_loops.yaml")
    with open(loops, "w") as f:
        f.write(f"- name: {AGENT_LOOP}\n  _target_: verl_capped_agent_loop.CappedSingleTurnAgentLoop\n")
    return dict(model=model_dir, data=data, reward=reward, agent_loops=loops, prompts=prompts, caps=caps)


def verl_overrides(args: argparse.Namespace, files: dict, workdir: str) -> list[str]:
    """Hydra overrides of verl's `main_ppo` (its ppo_trainer config) for this workload."""
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={files['data']}",
        f"data.val_files={files['data']}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}",
        "data.filter_overlong_prompts=false",
        "data.truncation=error",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={files['model']}",
        f"actor_rollout_ref.model.use_remove_padding={str(args.remove_padding).lower()}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_tokens}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.fsdp_config.param_offload=false",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={files['agent_loops']}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP}",
        f"reward.custom_reward_function.path={files['reward']}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.critic_warmup=0",
        "trainer.logger=[console]",
        "trainer.project_name=bench",
        "trainer.experiment_name=verl_grpo",
        f"trainer.n_gpus_per_node={args.gpus}",
        "trainer.nnodes=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.total_training_steps={args.steps}",
        # verl 0.9.1's default V1 trainer imports TransferQueue (its `verl-core` extra, not carried): the
        # legacy trainer (main_ppo_v0: the same GRPO, agent-loop rollout) runs without it
        "trainer.use_v1=false",
        "trainer.total_epochs=1000",
        f"trainer.default_local_dir={os.path.join(workdir, 'ckpt')}",
    ]


def parse_steps(lines) -> dict[int, dict[str, float]]:
    """Metrics per step from verl's console logger lines (`step:N - key:value - ...`, numpy scalars as
    `np.float64(x)`; Ray's `(TaskRunner pid=N)` prefix before `step:` is skipped)."""
    steps: dict[int, dict[str, float]] = {}
    for line in lines:
        m = STEP_LINE.search(line.strip())
        if m:
            steps[int(m.group(1))] = {k: float(v) for k, v in METRIC.findall(m.group(2))}
    return steps


def summarize(args: argparse.Namespace, caps: list[int], steps: dict[int, dict[str, float]]) -> dict:
    """The bench's JSON object from the per-step metrics. `step_s` is the median of the steps after the first
    (None with one step or none: the first step holds verl's warm-up and is reported as `first_step_s`)."""
    order = sorted(steps)
    times = [steps[s].get("timing_s/step", float("nan")) for s in order]
    steady = times[1:]
    step_s = statistics.median(steady) if steady else None
    tokens = args.n * sum(args.prompt_len + c for c in caps)

    def last_key(suffix: str) -> str | None:  # verl 0.9.1: actor/perf/max_memory_allocated_gb, perf/mfu/actor
        keys = [k for s in order for k in steps[s] if k == suffix or k.endswith("/" + suffix)]
        return keys[-1] if keys else None

    mem, mfu = last_key("max_memory_allocated_gb"), last_key("perf/mfu/actor")
    return {
        "system": "verl_grpo",
        "engine": "verl 0.9.1 fsdp + vllm (colocated)",
        "preset": args.preset,
        "lengths": {"kind": args.lengths, **describe(caps, args.response_len)},
        "remove_padding": args.remove_padding,
        "gradient_checkpointing": args.gradient_checkpointing,
        "max_tokens": args.max_tokens,
        "steps_done": len(order),
        "step_s": step_s,
        "first_step_s": times[0] if times else None,
        "step_s_all": times,
        "tokens": tokens,
        "tokens_per_s_per_gpu": tokens / step_s / args.gpus if step_s else None,
        "timing_s": {
            s: {k: v for k, v in steps[s].items() if k.startswith("timing_s/") and "/agent_loop/" not in k}
            for s in order
        },
        "mfu_update_actor": [steps[s].get(mfu) for s in order] if mfu else None,
        "peak_memory_gb": max((steps[s].get(mem, 0.0) for s in order), default=None) if mem else None,
    }


def main() -> None:
    args = parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="verl_grpo_")
    os.makedirs(workdir, exist_ok=True)
    device = "cpu" if args.prepare_only else "cuda"
    files = prepare(args, workdir, device=device)
    if args.prepare_only:
        print(json.dumps({k: v for k, v in files.items() if k not in ("prompts",)}), flush=True)
        return
    python = args.python or (VENV_PYTHON if os.path.exists(VENV_PYTHON) else sys.executable)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    cmd = [python, "-m", "verl.trainer.main_ppo", *verl_overrides(args, files, workdir)]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    lines = []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir
    )

    def on_term(signum, frame):  # run.sh's `timeout`: the steps logged so far still become the JSON
        result = summarize(args, files["caps"], parse_steps(lines))
        result.update(returncode=None, stopped_by_signal=signum)
        print(json.dumps(result), flush=True)
        proc.kill()
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    for line in proc.stdout:  # verl's log to stderr; only the JSON goes to stdout
        sys.stderr.write(line)
        lines.append(line)
    proc.wait()
    steps = parse_steps(lines)
    result = summarize(args, files["caps"], steps)
    result["returncode"] = proc.returncode
    print(json.dumps(result), flush=True)
    sys.exit(0 if proc.returncode == 0 and steps else 1)


if __name__ == "__main__":
    main()
