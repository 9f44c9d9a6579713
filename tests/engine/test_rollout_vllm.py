"""`rollout.backend=vllm` (engine/rollout/vllm_backend.py, vllm_weights.py).

CPU, world size none: the config.json written for vLLM round-trips to the same model, the weight loader fills
vLLM-shaped parameters exactly as vLLM shards the full HF tensors (TP=1 here; TP=2 with the vocab row
exchange in tests/engine/test_rollout_tp.py; MoE, FusedMoE's fused experts included, at TP 1 and 2 here), its
errors, and the message when vLLM is missing.
CPU, world size 1 (gloo, in process): VllmRollout built through build_rollout_engine against a stand-in for
vLLM 0.26 (tests/engine/fake_vllm.py): the launch environment, sleep / wake-up order, weight copy, per-row
seeds, stops and outputs, log-probs requested only when asked for (rollout.log_probs); and the architecture
checks made before vLLM starts.
GPU + vLLM (marked `vllm`): tests/engine/rollout_vllm_script.py under torchrun, 1 GPU (Qwen2: tied, QKV bias)
and 2 GPUs when present (Llama: untied, vocab 1000 so megatron's and vLLM's vocab shards differ), bfloat16;
MoE: Qwen3-MoE on 1 and 2 GPUs, Qwen2-MoE (gated shared expert) on 1.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import fake_vllm
import hf_tiny
import pytest
import torch
import torch.distributed as dist
from distributed import run_torchrun
from rollout_tp_script import expected_vllm_params, hf_tensors
from test_rollout_native import hf_log_probs, rollout_weights_from_hf

from engine.config import RolloutConfig
from engine.models.hf import HFCheckpoint
from engine.models.hf_config import model_config_from_hf
from engine.models.hf_map import WEIGHT_MAP, Split, hf_names, shard_from_hf
from engine.rollout import build_rollout_engine, vllm_backend
from engine.rollout.base import SamplingParams
from engine.rollout.vllm_backend import check_vllm_model, import_vllm, row_seed, write_hf_config
from engine.rollout.vllm_weights import load_rollout_weights, vocab_pieces
from engine.step.rollout import rollout_replica
from engine.tools.parity import hf_model_shape
from parallel.launch import free_port

SCRIPT = str(Path(__file__).with_name("rollout_vllm_script.py"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rollout_vllm_hf")
    return {f: hf_tiny.save_tiny(f, str(root / f), seed=i) for i, f in enumerate(hf_tiny.FAMILIES)}


def test_missing_vllm_names_the_key_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ImportError, match=r"rollout.backend=vllm needs vLLM.*pip install -e \.\[vllm\]"):
        import_vllm()
    with pytest.raises(ImportError, match="rollout.backend=native"):
        build_rollout_engine(RolloutConfig(backend="vllm"), None, torch.device("cpu"), 0)


@pytest.mark.parametrize("family", hf_tiny.FAMILIES + hf_tiny.MOE_FAMILIES)
def test_config_written_for_vllm_describes_the_same_model(tiny, family, tmp_path):
    if family not in tiny:
        tiny[family] = hf_tiny.save_tiny(family, str(tmp_path / family))
    shape = hf_model_shape(tiny[family], 1)
    out = write_hf_config(shape, str(tmp_path))
    assert model_config_from_hf(out) == model_config_from_hf(tiny[family])
    from transformers import AutoConfig

    theirs, ours = AutoConfig.from_pretrained(tiny[family]), AutoConfig.from_pretrained(out)
    assert type(theirs) is type(ours) and theirs.rope_parameters == ours.rope_parameters


@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_weight_loader_fills_vllm_parameters_as_vllm_shards_them(tiny, family):
    shape, weights = rollout_weights_from_hf(tiny[family])
    want = expected_vllm_params(hf_tensors(tiny[family]), shape.vocab_size, 1, 0)
    fake = {name: torch.full_like(t, float("nan")) for name, t in want.items()}
    stats = load_rollout_weights(fake, weights.params, shape, 0, 1, None)
    assert stats["tensors"] == len(weights.params) == len(want)
    for name in want:
        assert torch.equal(fake[name], want[name]), name


def test_weight_loader_errors(tiny):
    shape, weights = rollout_weights_from_hf(tiny["llama"])
    want = expected_vllm_params(hf_tensors(tiny["llama"]), shape.vocab_size, 1, 0)
    fake = {name: torch.zeros_like(t) for name, t in want.items()}
    with pytest.raises(KeyError, match="unwritten.*extra"):
        load_rollout_weights({**fake, "extra": torch.zeros(1)}, weights.params, shape, 0, 1, None)
    with pytest.raises(KeyError, match="no parameter 'model.layers.0.self_attn.qkv_proj.weight'"):
        load_rollout_weights(
            {k: v for k, v in fake.items() if "0.self_attn.qkv" not in k}, weights.params, shape, 0, 1, None
        )
    half = dict(fake, **{"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 48)})  # a TP=2 shard
    with pytest.raises(ValueError, match="tensor_parallel_size must equal rollout.tp"):
        load_rollout_weights(half, weights.params, shape, 0, 1, None)


def rollout_shards_from_hf(path: str, tp: int, rank: int) -> tuple:
    """(shape, params) of rollout-TP rank `rank` of `tp`, read through WEIGHT_MAP: dense tensors split over TP,
    routed experts whole (expert TP is 1), global layer and expert indices, as the rollout holds them."""
    shape = hf_model_shape(path, tp)
    params = {}
    with HFCheckpoint(path) as ckpt:
        for rule in WEIGHT_MAP:
            experts = range(shape.moe.num_experts if shape.moe and rule.expert else 1)
            layers = range(shape.num_layers) if "{layer}" in rule.megatron else [None]
            for layer, expert in ((la, e if rule.expert else None) for la in layers for e in experts):
                names = hf_names(rule, layer, expert)
                if names[0] not in ckpt:
                    continue
                hf = [ckpt.tensor(n) for n in names]
                t, r = (1, 0) if rule.expert else (tp, rank)
                if rule.split is Split.VOCAB:
                    rows = (shape.padded_vocab_size // t, *hf[0].shape[1:])
                elif rule.split is Split.ROW:
                    rows = (hf[0].shape[0], hf[0].shape[1] // t)
                elif rule.split is Split.REPLICATED:
                    rows = tuple(hf[0].shape)
                else:
                    rows = (sum(x.shape[0] for x in hf) // t, *hf[0].shape[1:])
                out = torch.empty(rows)
                shard_from_hf(rule, lambda i, index, hf=hf: hf[i][index], out, shape, t, r)
                params[rule.megatron.format(layer=layer, expert=expert)] = out
    return shape, params


@pytest.mark.parametrize("family", hf_tiny.MOE_FAMILIES)
def test_weight_loader_fills_vllm_moe_parameters_as_vllm_shards_them(family, tmp_path):
    """Qwen3-MoE (QK-norm) and Qwen2-MoE (QKV bias, gated shared expert, tied) at vLLM TP 1 and 2: the router,
    the shared expert and each expert's slot of FusedMoE's w13_weight / w2_weight equal what vLLM's own
    weight_loader puts there from the HF checkpoint (vocab 128: both engines split it into 64-row shards)."""
    path = hf_tiny.save_tiny(family, str(tmp_path / family), vocab_size=128)
    full = hf_tensors(path)
    for tp in (1, 2):
        for rank in range(tp):
            shape, params = rollout_shards_from_hf(path, tp, rank)
            want = expected_vllm_params(full, shape.vocab_size, tp, rank)
            assert want["model.layers.1.mlp.experts.routed_experts.w13_weight"].shape == (4, 2 * 32 // tp, 64)
            fake = {name: torch.full_like(t, float("nan")) for name, t in want.items()}
            stats = load_rollout_weights(fake, params, shape, rank, tp, None)
            assert stats["tensors"] == len(params)
            for name in want:
                assert torch.equal(fake[name], want[name]), (tp, rank, name)
    # an expert missing from the rollout leaves its slot unwritten; a whole expert of another shape is refused
    lacking = {k: v for k, v in params.items() if "local_experts.3.linear_fc2" not in k}
    with pytest.raises(
        KeyError, match=r"experts \[0, 1, 2\] fill vLLM's model.layers.0.mlp.experts.routed_experts.w2_weight"
    ):
        load_rollout_weights(fake, lacking, shape, rank, tp, None)
    narrow = dict(
        params, **{"decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.zeros(32, 64)}
    )
    with pytest.raises(ValueError, match="w13_weight has shape .4, 32, 64.*tensor_parallel_size"):
        load_rollout_weights(fake, narrow, shape, rank, tp, None)


def test_moe_backend_pins_the_triton_experts_and_fills_them(world_of_one, monkeypatch, tmp_path):
    """A MoE model starts vLLM with moe_backend="triton" (the backend whose FusedMoE weights keep the layout
    vLLM's weight loader gives them; auto picks FlashInfer off Hopper) and its first rollout fills every expert
    slot of `mlp.experts.routed_experts.w13_weight` / `w2_weight` as vLLM would from the checkpoint."""
    path = hf_tiny.save_tiny("qwen3_moe", str(tmp_path / "qwen3_moe"), vocab_size=128)
    shape, weights = rollout_weights_from_hf(path)
    want = expected_vllm_params(hf_tensors(path), shape.vocab_size, 1, 0)
    fake_vllm.install(monkeypatch, {name: torch.full_like(t, float("nan")) for name, t in want.items()})
    cfg = RolloutConfig(backend="vllm", cuda_graphs=False, max_num_seqs=16, gpu_memory_utilization=0.3)
    engine = build_rollout_engine(cfg, shape, torch.device("cuda", 0), 0, model_dir=path, seed=5)
    llm = fake_vllm.LLM.instances[-1]
    assert llm.kwargs["moe_backend"] == "triton"
    engine.set_weights(weights)
    engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=2, seed=3))
    for name in want:
        assert torch.equal(llm.model.params[name].data, want[name]), name


@pytest.mark.parametrize(
    "vocab, src, dst, tp", [(101, 51, 64, 2), (151936, 37984, 37984, 4), (1000, 250, 256, 4)]
)
def test_vocab_pieces_cover_the_vocabulary_once(vocab, src, dst, tp):
    rows = [r for s, d, lo, hi in vocab_pieces(vocab, src, dst, tp) for r in range(lo, hi)]
    assert sorted(rows) == list(range(vocab))
    for s, d, lo, hi in vocab_pieces(vocab, src, dst, tp):
        assert s * src <= lo < hi <= (s + 1) * src and d * dst <= lo < hi <= (d + 1) * dst


def test_row_seeds_differ_per_row_and_repeat():
    assert len({row_seed(3, r) for r in range(1000)}) == 1000 and row_seed(3, 5) == row_seed(3, 5)


# ---- the backend's control flow against a stand-in for vLLM 0.26 (tests/engine/fake_vllm.py) ----------


@pytest.fixture
def world_of_one(monkeypatch):
    """torch.distributed on gloo, world size 1, with the torchrun variables vLLM's external launcher reads;
    LOCAL_RANK=3 as under SLURM with one GPU per task (the backend must point vLLM at cuda:0)."""
    port = free_port()
    for key, value in dict(RANK="0", LOCAL_RANK="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_backend_drives_vllm_as_0_26_expects(tiny, world_of_one, monkeypatch):
    shape, weights = rollout_weights_from_hf(tiny["qwen2"])
    want = expected_vllm_params(hf_tensors(tiny["qwen2"]), shape.vocab_size, 1, 0)
    fake_vllm.install(monkeypatch, {name: torch.full_like(t, float("nan")) for name, t in want.items()})
    cfg = RolloutConfig(backend="vllm", cuda_graphs=False, max_num_seqs=16, gpu_memory_utilization=0.3)
    engine = build_rollout_engine(cfg, shape, torch.device("cuda", 0), 0, model_dir=tiny["qwen2"], seed=5)
    llm = fake_vllm.LLM.instances[-1]
    assert llm.env == {"LOCAL_RANK": "0", "RANK": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert os.environ["LOCAL_RANK"] == "3"  # restored once vLLM has started
    assert llm.kwargs["enforce_eager"] and llm.kwargs["seed"] == 5 and llm.kwargs["load_format"] == "dummy"
    assert "moe_backend" not in llm.kwargs  # dense: vLLM's own choice
    assert llm.calls == ["sleep(2)"] and engine.uses_v2_model_runner

    engine.set_weights(weights)
    prompts = [[1, 2, 3], [4, 5], [6]]
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    a = engine.generate(prompts, sampling)
    assert llm.calls[1:] == [
        "wake_up(['weights'])",
        "apply_model",
        "wake_up(['kv_cache'])",
        "reset_prefix_cache",
        "generate",
        "sleep(2)",
    ]
    for name in want:
        assert torch.equal(llm.model.params[name].data, want[name]), name
    assert engine.last_stats["tensors"] == len(want)
    assert a.response_ids.shape == (6, 6) and a.finish_reasons == ["length"] * 6
    assert torch.equal(a.response_ids, engine.generate(prompts, sampling).response_ids)  # seeded per row
    assert not torch.equal(a.response_ids, engine.generate(prompts, replace(sampling, seed=4)).response_ids)
    assert not torch.equal(a.response_ids[0], a.response_ids[1])  # the n samples of a prompt differ
    assert torch.allclose(a.log_probs[0], -1.0 - 0.01 * torch.arange(6.0))

    stop = int(a.response_ids[2, 2])
    b = engine.generate(prompts, replace(sampling, stop_token_ids=(stop,)))
    length = int(b.response_mask[2].sum())
    assert b.finish_reasons[2] == "stop" and b.response_ids[2, length - 1] == stop and length <= 3
    assert b.response_ids[2, length:].eq(0).all() and b.log_probs[2, length:].eq(0).all()
    assert (
        engine.generate(prompts, replace(sampling, stop_token_ids=(stop,), ignore_eos=True)).finish_reasons
        == ["length"] * 6
    )
    # per-prompt limits (long-tailed benchmark workloads): each prompt's n rows stop at its own max_tokens
    limited = engine.generate(
        prompts, replace(sampling, max_new_tokens_per_prompt=(2, 6, 1), ignore_eos=True)
    )
    assert limited.response_mask.sum(-1).tolist() == [2, 2, 6, 6, 1, 1] and limited.response_ids.shape == (
        6,
        6,
    )
    assert limited.finish_reasons == ["length"] * 6
    with pytest.raises(ValueError, match="2 limits for 3 prompts"):
        engine.generate(prompts, replace(sampling, max_new_tokens_per_prompt=(2, 6)))
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2))
    assert greedy.response_ids[:, 0].tolist() == [6 % shape.vocab_size, 9, 6]
    lp = engine.sequence_log_probs([[1, 2, 3], [4, 5]])
    assert [t.tolist() for t in lp] == [pytest.approx([-0.51, -0.52]), pytest.approx([-0.51])]
    assert llm.calls[-1] == "sleep(2)" and llm.llm_engine.is_sleeping()
    # vLLM's sleep collects garbage: the backend has dropped vLLM's outputs (a Logprob per token) before it
    alive = llm.outputs_alive_at_sleep
    assert len(alive) == llm.calls.count("sleep(2)") and not any(alive), alive


def test_out_of_memory_on_wake_up_names_the_keys_that_fix_it(tiny, world_of_one, monkeypatch):
    shape, weights = rollout_weights_from_hf(tiny["qwen2"])
    fake_vllm.install(monkeypatch, expected_vllm_params(hf_tensors(tiny["qwen2"]), shape.vocab_size, 1, 0))
    monkeypatch.setattr(vllm_backend, "device_memory", lambda device: (50 * 2**30, 140 * 2**30))
    cfg = RolloutConfig(backend="vllm", cuda_graphs=False, gpu_memory_utilization=0.5)
    engine = build_rollout_engine(cfg, shape, torch.device("cuda", 0), 0, model_dir=tiny["qwen2"])
    engine.set_weights(weights)
    llm = fake_vllm.LLM.instances[-1]
    llm.out_of_memory_on = "kv_cache"
    with pytest.raises(RuntimeError, match="out of memory") as err:
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    msg = str(err.value)
    assert "50.0 of 140.0 GiB free" in msg and "up to 70.0 GiB" in msg, msg
    for fix in ("rollout.gpu_memory_utilization", "trainer.offload_optimizer=true", "rollout.backend=native"):
        assert fix in msg, msg

    def unrelated_failure(tags=None):
        raise RuntimeError("an unrelated failure")

    monkeypatch.setattr(llm, "wake_up", unrelated_failure)
    with pytest.raises(RuntimeError, match="^an unrelated failure$"):  # other errors pass through as they are
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_backend_asks_vllm_for_log_probs_only_when_needed(tiny, world_of_one, monkeypatch):
    """SamplingParams.log_probs=False (rollout.log_probs=false): every request has logprobs=None, so vLLM
    computes none (measured on one H200: ~40% more tokens/s); same responses, RolloutOutput.log_probs None,
    also through engine/step/rollout.py."""
    shape, weights = rollout_weights_from_hf(tiny["qwen2"])
    want = expected_vllm_params(hf_tensors(tiny["qwen2"]), shape.vocab_size, 1, 0)
    fake_vllm.install(monkeypatch, {name: torch.zeros_like(t) for name, t in want.items()})
    cfg = RolloutConfig(backend="vllm", cuda_graphs=False)
    engine = build_rollout_engine(cfg, shape, torch.device("cuda", 0), 0, model_dir=tiny["qwen2"])
    llm = fake_vllm.LLM.instances[-1]
    engine.set_weights(weights)
    prompts = [[1, 2, 3], [4, 5]]
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=3)

    full = engine.generate(prompts, sampling)
    assert [p.logprobs for p in llm.last_params] == [0] * 4 and full.log_probs.shape == (4, 5)
    bare = engine.generate(prompts, replace(sampling, log_probs=False))
    assert [p.logprobs for p in llm.last_params] == [None] * 4
    assert bare.log_probs is None
    assert torch.equal(bare.response_ids, full.response_ids) and torch.equal(
        bare.response_mask, full.response_mask
    )
    assert bare.finish_reasons == full.finish_reasons
    assert rollout_replica(engine, weights, prompts, replace(sampling, log_probs=False)).log_probs is None
    assert torch.equal(rollout_replica(engine, weights, prompts, sampling).log_probs, full.log_probs)


def test_log_probs_are_the_full_distribution_at_the_temperature_on_both_backends(
    tiny, world_of_one, monkeypatch
):
    """With top-p/top-k the rollout log-prob is still log_softmax(logits / T) over the whole vocabulary (what the
    training forward computes), on vLLM (the fake runs vLLM 0.26's sampler and log-prob modes on the
    transformers model) as on the native engine: T = 1 with top_p < 1 and top_k (vLLM's raw log-probs), T = 0.7
    without truncation (processed); T = 0.7 with top_p < 1 is refused (neither mode gives it). float32, 1e-4."""
    from transformers import AutoModelForCausalLM

    from engine.rollout.native import NativeRollout

    hf = AutoModelForCausalLM.from_pretrained(tiny["qwen2"], dtype=torch.float32).eval()
    shape, weights = rollout_weights_from_hf(tiny["qwen2"])
    params = expected_vllm_params(hf_tensors(tiny["qwen2"]), shape.vocab_size, 1, 0)
    fake_vllm.install(monkeypatch, params, logits_fn=lambda ids: hf(torch.tensor([ids])).logits[0, -1])
    native = NativeRollout(shape, torch.device("cpu"), pad_id=0)
    native.set_weights(weights)
    prompts = [[1, 2, 3], [4, 5]]
    for temperature, top_p, top_k in ((1.0, 0.7, 0), (1.0, 0.9, 20), (0.7, 1.0, 0)):
        cfg = RolloutConfig(
            backend="vllm", cuda_graphs=False, temperature=temperature, top_p=top_p, top_k=top_k
        )
        engine = build_rollout_engine(cfg, shape, torch.device("cuda", 0), 0, model_dir=tiny["qwen2"])
        engine.set_weights(weights)
        sampling = SamplingParams(
            n=2, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=6, seed=3
        )
        for name, out in (
            ("vllm", engine.generate(prompts, sampling)),
            ("native", native.generate(prompts, sampling)),
        ):
            for row in range(4):
                ref = hf_log_probs(hf, prompts[row // 2], out.response_ids[row].tolist(), temperature)
                torch.testing.assert_close(out.log_probs[row], ref, atol=1e-4, rtol=0, msg=f"{name} {cfg}")
    sampling = replace(sampling, top_p=0.9)
    with pytest.raises(ValueError, match=r"temperature=0.7 with top_p=0.9.*Fix: rollout.temperature=1.0"):
        engine.generate(prompts, sampling)
    assert engine.generate(prompts, replace(sampling, log_probs=False)).log_probs is None
    assert vllm_backend.full_log_probs_mode(0.7, 0.9, 0) is None


def test_vllm_model_checks_before_vllm_starts(tiny, tmp_path):
    shape = hf_model_shape(tiny["qwen2"], 1)
    check_vllm_model(shape, tiny["qwen2"])
    with pytest.raises(ValueError, match=r"differs from the rollout model shape in num_layers"):
        check_vllm_model(replace(shape, num_layers=shape.num_layers + 1), tiny["qwen2"])
    with pytest.raises(ValueError, match="vLLM's Qwen2 attention ignores head_dim"):
        check_vllm_model(replace(shape, head_dim=2 * shape.head_dim), None)
    moe_dir = hf_tiny.save_tiny("qwen3_moe", str(tmp_path / "qwen3_moe"))
    moe = hf_model_shape(moe_dir, 1)
    check_vllm_model(moe, moe_dir)
    with pytest.raises(ValueError, match=r"moe.num_experts: 4 vs 8"):
        check_vllm_model(replace(moe, moe=replace(moe.moe, num_experts=8)), moe_dir)


# ---- GPU + vLLM --------------------------------------------------------------------------------------


def _bf16_model(tmp_path, family: str, **overrides) -> str:
    dims = dict(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    return hf_tiny.save_tiny(family, str(tmp_path / family), **{**dims, **overrides})


def _run(tmp_path, family: str, nproc: int, **overrides) -> dict:
    out = run_torchrun(SCRIPT, nproc, [_bf16_model(tmp_path, family, **overrides)], timeout=1200)
    report = json.loads(next(line for line in out.splitlines() if "RESULT {" in line).split("RESULT ", 1)[1])
    print("RESULT " + json.dumps(report))  # shown by pytest -rA
    return report


@pytest.mark.vllm
def test_vllm_matches_native_and_training_on_one_gpu(tmp_path):
    import_vllm()
    report = _run(tmp_path, "qwen2", 1, vocab_size=2048)
    assert report["greedy_first_token_agree"] >= 0.75, report  # bf16 near-ties: see rollout_vllm_script.py


@pytest.mark.vllm
def test_vllm_tp2_matches_native_and_training_on_two_gpus(tmp_path):
    import_vllm()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    report = _run(tmp_path, "llama", 2, vocab_size=1000)  # 1000: megatron's shard 500 rows, vLLM's 512
    assert report["greedy_first_token_agree"] >= 0.75, report  # bf16 near-ties: see rollout_vllm_script.py


@pytest.mark.vllm
@pytest.mark.parametrize("family, nproc", [("qwen3_moe", 1), ("qwen2_moe", 1), ("qwen3_moe", 2)])
def test_vllm_moe_matches_native_and_training(tmp_path, family, nproc):
    """MoE weights loaded into vLLM's FusedMoE (w13 / w2 per expert, the router, Qwen2-MoE's gated shared
    expert): greedy first tokens agree with the native engine on >= 6 of 8 rows, and teacher-forced log-probs
    are as close to the training forward as the native engine's (bf16; the rules of rollout_vllm_script.py)."""
    import_vllm()
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
    if family == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = 512
    report = _run(tmp_path, family, nproc, vocab_size=2048, **moe)
    assert report["greedy_first_token_agree"] >= 0.75, report
