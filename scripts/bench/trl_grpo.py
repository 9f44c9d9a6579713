"""Baseline for scripts/bench/e2e.py: TRL's GRPOTrainer on the same random-init architecture, batch, group
size and lengths (transformers `generate`, beta 0, one PPO iteration per step, EOS suppressed with
min_new_tokens). Prints one JSON line: per-step seconds and tokens/s/GPU. One GPU.

    python scripts/bench/trl_grpo.py --preset qwen2_5_0_5b --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from presets import hf_config_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_0_5b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="what 7B needs on one GPU")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from engine.data import load_tokenizer
    from engine.tasks.embedded import build_embedded_tokenizer

    tmp = tempfile.mkdtemp()
    tokenizer = load_tokenizer(build_embedded_tokenizer(os.path.join(tmp, "tok")))
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: minutes on the CPU at 7B
        model = Qwen2ForCausalLM(Qwen2Config(**hf_config_for(args.preset))).to(torch.bfloat16)
    digits = "0123456789"
    prompts = [
        "".join(digits[(i * 7 + j) % 10] for j in range(args.prompt_len - 1)) for i in range(args.prompts * 4)
    ]
    dataset = Dataset.from_dict({"prompt": prompts})

    rows = args.prompts * args.n
    config = GRPOConfig(
        output_dir=os.path.join(tmp, "out"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,
        num_generations=args.n,
        max_completion_length=args.response_len,
        generation_kwargs={"min_new_tokens": args.response_len},
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        bf16=True,
        learning_rate=1e-6,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=args.gradient_checkpointing,
    )
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steady = times[1:] or times
    step_s = statistics.median(steady)
    tokens = rows * (args.prompt_len + args.response_len)
    print(
        json.dumps(
            {
                "system": "trl_grpo",
                "preset": args.preset,
                "micro_batch": args.micro_batch,
                "gradient_checkpointing": args.gradient_checkpointing,
                "step_s": step_s,
                "step_s_all": times,
                "tokens_per_s_per_gpu": tokens / step_s,
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
