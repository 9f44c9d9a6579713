"""What our vLLM rollout's request options cost: one vLLM 0.26 engine (configured as
engine/rollout/vllm_backend.py configures it, random weights), the same 512 prompts x 256 tokens -> 512 new
tokens (EOS ignored, temperature 1), generated with and without the two options the backend sets on every
request: `logprobs=0` (the sampled token's log-prob) and a per-request `seed`. One process, one GPU.

    python scripts/bench/vllm_sampling_cost.py --preset qwen2_5_0_5b --max-model-len 1024

Prints one JSON object: seconds and tokens/s per variant (one timed generate each, after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_0_5b")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the model's max_position_embeddings")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    args = ap.parse_args()
    import tempfile

    import torch
    import vllm
    from presets import hf_config_for

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16"}
    cfg.update(hf_config_for(args.preset))
    model_dir = tempfile.mkdtemp(prefix="vllm-cost-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    kwargs = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = vllm.LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.prompts,
        enable_sleep_mode=True,
        seed=0,
        logprobs_mode="processed_logprobs",
        **kwargs,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
    prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in ids]

    def params(logprobs: bool, seeds: bool) -> list:
        return [
            vllm.SamplingParams(
                temperature=1.0,
                max_tokens=args.new_tokens,
                ignore_eos=True,
                detokenize=False,
                logprobs=0 if logprobs else None,
                seed=r if seeds else None,
            )
            for r in range(args.prompts)
        ]

    out = {"preset": args.preset, "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len}
    llm.generate(prompts[:8], params(True, True)[:8], use_tqdm=False)  # warm-up (both paths)
    llm.generate(prompts[:8], params(False, False)[:8], use_tqdm=False)
    for name, lp, sd in (
        ("plain", False, False),
        ("logprobs", True, False),
        ("seeds", False, True),
        ("ours", True, True),
    ):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = llm.generate(prompts, params(lp, sd), use_tqdm=False)
        torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        tokens = sum(len(r.outputs[0].token_ids) for r in res)
        out[name] = {"seconds": round(sec, 3), "tokens_per_s": round(tokens / sec)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
