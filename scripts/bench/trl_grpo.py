"""Baseline for scripts/bench/e2e.py: TRL's GRPOTrainer on the same random-init architecture, batch, group
size and response lengths (beta 0, one PPO iteration per step). Prints one JSON line: per-step seconds and
tokens/s/GPU. One GPU.

    python scripts/bench/trl_grpo.py --preset qwen2_5_0_5b --steps 3
    python scripts/bench/trl_grpo.py --preset qwen2_5_0_5b --lengths long_tail --response-len 4096 --vllm

Workload: `--prompts` distinct digit prompts of `--prompt-len` - 1 characters (the embedded character-level
tokenizer: one token each, no chat template: TRL takes plain strings as they are), `--n` completions each.
Prompt i's response length is `workload.response_lengths(--lengths, --prompts, --response-len, --seed)[i]`,
the draw e2e.py and rollout.py make with the same arguments. The dataset holds exactly the `--prompts`
prompts, so every step (one generation batch of prompts x n rows) covers each of them once.

How each engine enforces the lengths:
- transformers `generate` (default): `--lengths fixed`: `generation_kwargs={"min_new_tokens": L}` (EOS
  suppressed before L; `max_completion_length=L` ends every completion at L tokens, no EOS). `long_tail`: the
  bench wraps the policy's `generate` (the call TRL's `_generate_single_turn` makes) to add `RowCapLogitsProcessor`:
  it reads each row's prompt from the left-padded `input_ids` and `attention_mask`, looks up its cap, suppresses
  EOS before the cap and forces EOS at it. A completion is then cap tokens + EOS (a row at the limit: L tokens,
  no EOS); TRL's completion mask runs to and including the first EOS, so TRL trains cap + 1 tokens per row
  (L at the limit). The reported tokens count cap tokens per row (the workload's), not the EOS.
- vLLM (`--vllm`: `use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3`; the model is saved to
  a directory vLLM loads): TRL builds one `SamplingParams` from `generation_kwargs`, here
  `{"min_tokens": L, "ignore_eos": True}` (fixed) or `{"ignore_eos": True}` (long_tail), and calls
  `LLM.generate` once per generation batch. For `long_tail` the bench wraps that `LLM.generate` to pass a list
  of per-prompt copies of it (`per_prompt_sampling`: `max_tokens = min_tokens = cap`, looked up from each
  request's prompt ids), so each completion is exactly cap tokens with no EOS sampled, like vLLM's per-request
  limits in our engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(__file__))
from presets import hf_config_for  # noqa: E402
from workload import add_step_args, describe, response_lengths  # noqa: E402


def bench_prompts(num_prompts: int, prompt_len: int, seed: int) -> list[str]:
    """`num_prompts` distinct digit strings of prompt_len - 1 characters (distinct: caps are looked up by
    prompt), the same for the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt_len - 1
    tag_width = len(str(num_prompts - 1))
    if width < tag_width + 1:
        raise ValueError(f"--prompt-len {prompt_len} is too short to tell {num_prompts} prompts apart")
    body = torch.randint(0, 10, (num_prompts, width - tag_width), generator=gen).tolist()
    return [f"{i:0{tag_width}d}" + "".join(map(str, row)) for i, row in enumerate(body)]


def cap_lookup(tokenizer, prompts: Sequence[str], caps: Sequence[int]) -> Callable[[Sequence[int]], int]:
    """A function from a prompt's token ids (no padding) to its cap; an unknown prompt is an error."""
    table = dict(zip(prompts, caps))

    def cap_of(ids: Sequence[int]) -> int:
        text = tokenizer.decode(list(ids), skip_special_tokens=True)
        if text not in table:
            raise KeyError(f"no response cap for prompt {text[:40]!r}: not one of the bench's prompts")
        return table[text]

    return cap_of


class RowCapLogitsProcessor:
    """transformers logits processor: row r may not end before `caps[r]` new tokens and ends right there.

    Suppresses EOS while fewer than caps[r] tokens are generated and forces it at caps[r] (a row past its cap
    has finished: generate only pads it). `prompt_width`: the padded prompt's width (new tokens = input width
    - prompt_width)."""

    def __init__(self, caps: torch.Tensor, prompt_width: int, eos_id: int):
        self.caps, self.prompt_width, self.eos_id = caps, prompt_width, eos_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        done = input_ids.shape[1] - self.prompt_width  # tokens generated so far
        caps = self.caps.to(scores.device)
        scores = scores.clone()
        scores[caps > done, self.eos_id] = float("-inf")
        at_cap = caps <= done
        scores[at_cap] = float("-inf")
        scores[at_cap, self.eos_id] = 0.0
        return scores


def with_row_caps(generate: Callable, cap_of: Callable[[Sequence[int]], int], eos_id: int) -> Callable:
    """Wrap a transformers `generate` so every call adds a RowCapLogitsProcessor for its rows' prompts."""
    from transformers import LogitsProcessorList

    def capped_generate(*args, **kwargs):
        input_ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        caps = torch.tensor([cap_of(ids[m.bool()].tolist()) for ids, m in zip(input_ids.cpu(), mask.cpu())])
        processor = RowCapLogitsProcessor(caps, input_ids.shape[1], eos_id)
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])
        return generate(*args, **kwargs)

    return capped_generate


def per_prompt_sampling(requests: Sequence, base, cap_of: Callable[[Sequence[int]], int]) -> list:
    """One copy of vLLM SamplingParams `base` per request ({"prompt_token_ids": ids} or ids), each with
    max_tokens = min_tokens = the prompt's cap (`base` keeps ignore_eos=True from generation_kwargs)."""
    out = []
    for request in requests:
        ids = request["prompt_token_ids"] if isinstance(request, dict) else request
        params = base.clone()
        params.max_tokens = params.min_tokens = cap_of(ids)
        out.append(params)
    return out


def with_per_prompt_sampling(llm_generate: Callable, cap_of: Callable[[Sequence[int]], int]) -> Callable:
    """Wrap vLLM's `LLM.generate` (called by TRL with one SamplingParams) to pass per-prompt ones."""

    def capped_generate(prompts, sampling_params=None, **kwargs):
        return llm_generate(
            prompts, sampling_params=per_prompt_sampling(prompts, sampling_params, cap_of), **kwargs
        )

    return capped_generate


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_0_5b")
    add_step_args(ap)
    ap.add_argument(
        "--vllm", action="store_true", help="TRL's colocated vLLM instead of transformers generate"
    )
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="what 7B needs on one GPU")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
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
    if args.vllm:  # vLLM loads the model from a directory (model.name_or_path)
        model_dir = os.path.join(tmp, "model")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    prompts = bench_prompts(args.prompts, args.prompt_len, args.seed)
    lengths = response_lengths(args.lengths, args.prompts, args.response_len, args.seed)
    dataset = Dataset.from_dict({"prompt": prompts})
    long_tail = args.lengths != "fixed"
    if args.vllm:
        generation_kwargs = {"ignore_eos": True, **({} if long_tail else {"min_tokens": args.response_len})}
        engine_kwargs = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    else:
        generation_kwargs = {} if long_tail else {"min_new_tokens": args.response_len}
        engine_kwargs = {}

    rows = args.prompts * args.n
    config = GRPOConfig(
        output_dir=os.path.join(tmp, "out"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,
        num_generations=args.n,
        max_completion_length=args.response_len,
        generation_kwargs=generation_kwargs,
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
        **engine_kwargs,
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
    if long_tail:
        cap_of = cap_lookup(tokenizer, prompts, lengths)
        if args.vllm:
            llm = trainer.vllm_generation.llm
            llm.generate = with_per_prompt_sampling(llm.generate, cap_of)
        else:
            model.generate = with_row_caps(model.generate, cap_of, tokenizer.eos_token_id)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steady = times[1:] or times
    step_s = statistics.median(steady)
    tokens = args.n * sum(args.prompt_len + length for length in lengths)  # real tokens, EOS not counted
    print(
        json.dumps(
            {
                "system": "trl_grpo",
                "engine": "vllm" if args.vllm else "generate",
                "preset": args.preset,
                "lengths": {"kind": args.lengths, **describe(lengths, args.response_len)},
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
