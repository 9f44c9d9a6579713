"""Split placement (`placement.mode=split`) end to end on CPU/gloo: `python -m engine.train` under torchrun with
training ranks and rollout ranks, against colocated runs of the same job.

Bit-exact (compared with ==) on every non-timing metric (rewards, losses, grad norms, KL, entropy): split with
trainer.off_policy_steps=0 equals colocated, because each rollout replica generates a training replica's
prompts (or its share of them) with the colocated path's loader, seeds and scoring. Excluded: timing/*,
perf/* (wall clock) and rollout_engine/* (the engine's counters depend on how many prompts one call holds).

Launches: 3 ranks (2 train + 1 rollout) whose rollout rank gets stuck inside step 3 after step 2's checkpoint
(the training ranks time out, name it and kill it), then resumed (trainer.resume=auto), against colocated DP=2, both scored by a reward model (reward.combine=sum: the
rollout rank scores the rule, the training ranks add the model's score, in training and validation); 4 ranks (TP=2 train + 2 rollout replicas sharing its
prompts) against colocated TP=2 with sequence parallelism and rollout.tp=1 (a micro-DP group of 2); 3 ranks one step off policy
(trainer.off_policy_steps=1) for 40 steps of the embedded task; 2 ranks one step off policy killed after step 2's
checkpoint and resumed (the batch in flight is regenerated); PPO with the critic on a rank of its own
(placement.critic_ranks=1, 3 ranks; killed inside step 3 and resumed) against the critic on the actor's rank
(2 ranks); multi-turn episodes with the calculator on 2 ranks (1 train + 1 rollout) against colocated at world
size 1 (in this process); model=tiny_moe (parallel.ep=1) on 2 ranks against colocated at world size 1. GPU + vLLM (marked
`vllm`): 1 + 1 GPUs with rollout.backend=vllm against colocated vLLM on 1 GPU (on CPU,
tests/parallel/hybrid_reshard_script.py feeds the received shards to the vLLM backend against
tests/engine/fake_vllm.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import hf_tiny
import pytest
from distributed import run_torchrun
from trainer_jobs import CALCULATOR_TASK

from engine.checkpoint.store import latest_checkpoint
from engine.step_profiler import phase_windows, trace_path
from engine.tasks.embedded import EMBEDDED_VOCAB, write_embedded_dataset
from parallel.layout import TrainLayout
from parallel.split_plan import SplitLayout

REWARD = f"reward.fn={os.path.join(os.path.dirname(__file__), 'stall_reward.py')}:score"
DICT_REWARD = f"{os.path.join(os.path.dirname(__file__), 'dict_reward.py')}:score"
RUN = [
    "trainer.total_steps=4",
    "trainer.test_freq=0",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "trainer.plot=false",
    "trainer.save_freq=2",
    "data.batch_size=4",
    "rollout.n=4",
    "trainer.micro_batch_size=4",
    REWARD,
]
SPLIT = ["placement.mode=split"]
STUCK_FOR_S = 20.0
"""cluster.timeout_s of a run whose rollout rank gets stuck: above any wait of a healthy step here."""


def _validation(tmp_path, test_freq: int) -> list[str]:
    """Validation every `test_freq` steps on 7 prompts of the embedded task (a parquet file of its own), each
    with a greedy and rollout.val_n=2 sampled responses (7: two training replicas run a repeat to even out
    their shares, which neither counts)."""
    val = write_embedded_dataset(str(tmp_path / "val"), "copy", 7, 4, seed=7, split="val")
    return [f"trainer.test_freq={test_freq}", "rollout.val_n=2", f"data.val_files=[{val}]"]


def _metrics(out) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {row["step"]: row for row in rows}


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "rollout_engine/"))}


def _train(nproc: int, out, *overrides: str) -> dict[int, dict]:
    run_torchrun("-m", nproc, ["engine.train", f"trainer.output_dir={out}", *RUN, *overrides])
    return _metrics(out)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks: each in a session of its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _kill_job(proc: subprocess.Popen, rank_groups: list[int] | None = None) -> None:
    """SIGKILL every rank's process group (the ranks and what they started; `rank_groups` if the ranks may have
    ended already), then torchrun's."""
    if rank_groups is None:
        rank_groups = [os.getpgid(pid) for pid in _children(proc.pid)]
    for group in [*rank_groups, proc.pid]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def _killed_in_step_3(out, *overrides: str, stuck_for_s: float = 0.0, nproc: int = 3) -> str:
    """A split run (`nproc` ranks) SIGKILLed (all ranks) while its rollout rank scores step 3 (one step off
    policy: step 3 or 4), after step 2's save; its output. With `stuck_for_s` (cluster.timeout_s) the test kills nobody: the other ranks' collectives time
    out while the rollout rank is stuck, they name it, kill it and end the job."""
    stall_at = os.path.join(out, "checkpoints", "global_step_2")
    env = dict(os.environ, OMP_NUM_THREADS="1", STALL_AFTER_CHECKPOINT=stall_at)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "engine.train", f"trainer.output_dir={out}", *RUN, *overrides]
    if stuck_for_s:
        cmd.append(f"cluster.timeout_s={stuck_for_s:g}")
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    rank_groups = None
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{stall_at}.stalled"):
            assert proc.poll() is None, f"the run ended before stalling:\n{proc.stdout.read()[-6000:]}"
            assert time.monotonic() < deadline, "no stall within 300 s"
            time.sleep(0.05)
        if not stuck_for_s:
            return ""
        rank_groups = [os.getpgid(pid) for pid in _children(proc.pid)]  # the stuck rank's reward worker too
        stuck = time.monotonic()
        output = proc.communicate(timeout=stuck_for_s + 60)[0]
        assert time.monotonic() - stuck < stuck_for_s + 15, output[-6000:]  # the job ended by itself
        return output
    finally:
        _kill_job(proc, rank_groups)


def test_split_3_ranks_equals_colocated_dp2_and_resumes_after_sigkill(tmp_path):
    """Validation after steps 3 and 4 (the last) of the resumed run equals colocated's too. (None before the
    kill: validation after step 2 would send step 3's weights before step 2's checkpoint exists, and step 3
    could then be scored, not stalled, before it does.) A reward model scores on the training ranks and
    its score is added to the rule's (reward.combine=sum), as colocated adds them. The stuck rollout rank ends
    the run within cluster.timeout_s, named with its side and coordinates by both training ranks."""
    # the embedded tokenizer's vocabulary, so the reward model reads the actor's token ids
    reward_model = hf_tiny.save_tiny(
        "qwen2", str(tmp_path / "rm"), seed=3, head="sequence", vocab_size=len(EMBEDDED_VOCAB)
    )
    validation = [*_validation(tmp_path, 3), f"reward.model_path={reward_model}", "reward.combine=sum"]
    colocated = _train(2, tmp_path / "colocated", *validation)

    split = ["placement.mode=split", "placement.rollout_ranks=1", *validation]
    out = tmp_path / "split"
    output = _killed_in_step_3(out, *split, stuck_for_s=STUCK_FOR_S)
    assert sorted(_metrics(out)) == [1, 2]  # killed inside step 3
    # both training ranks time out waiting for step 3's responses and name the stuck rollout rank
    for rank in (0, 1):
        note = (
            f"training rank {rank} of 3: a collective waited longer than cluster.timeout_s={STUCK_FOR_S:g}s"
        )
        assert note in output, output[-6000:]
    assert "Rank(s) [2] did not arrive (rollout rank 2 at rollout TP 0, DP 0)" in output, output[-6000:]
    rows = _train(3, out, *split, "trainer.resume=auto")
    assert sorted(rows) == [1, 2, 3, 4]
    for step, row in rows.items():
        assert _comparable(row) == _comparable(colocated[step]), step
        for key in ("timing/wait_rollout", "timing/wait_train", "timing/gen"):
            assert row[key] >= 0, (step, key)
    # validation after step 3 sent step 4's weights (timed in step 3's timing/testing)
    assert [s for s in rows if "timing/weight_transfer" in rows[s]] == [1, 2, 3]
    assert "actor/grad_norm" in rows[4] and "reward/mean" in rows[4]
    assert [s for s in rows if "val/reward_mean" in rows[s]] == [3, 4]
    assert all(rows[s]["timing/reward_model"] >= 0 for s in rows)  # scored on the training ranks
    assert "val/embedded/copy/maj@2" not in rows[4]  # with a reward model no majority vote (as colocated)


def test_split_tp2_train_2_rollout_replicas_equals_colocated_micro_dp(tmp_path):
    """4 ranks: TP=2 with sequence parallelism trains (DP=1), two rollout replicas generate one half of its
    prompts each; with DAPO's dynamic sampling (further rounds until the batch has enough groups whose rewards
    differ), validation after every step and a reward returning a dict, whose extra `acc` is joined over the
    rounds and the replicas' shares."""
    short = [
        "trainer.total_steps=2",
        "trainer.save_freq=0",
        "parallel.tp=2",
        "parallel.sp=true",
        "rollout.tp=1",
        f"reward.fn={DICT_REWARD}",  # after RUN's reward.fn: the last override wins
    ]
    short += ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3", *_validation(tmp_path, 1)]
    colocated = _train(2, tmp_path / "colocated", *short)
    profiled = "trainer.profile_steps=[2]"  # every rank traces step 2, the rollout ranks too
    split = _train(
        4, tmp_path / "split", *short, "placement.mode=split", "placement.rollout_ranks=2", profiled
    )
    assert sorted(split) == [1, 2]
    for step, row in split.items():
        assert _comparable(row) == _comparable(colocated[step]), step
        assert "val/reward_mean" in row and "val/embedded/copy/mean@2" in row, step
        assert "reward/extra/acc" in row and "val/embedded/copy/extra/acc/mean@2" in row, step
    assert max(row["dynamic_sampling/rounds"] for row in split.values()) > 1  # further rounds ran
    phases = {}
    for rank in range(4):
        with open(trace_path(str(tmp_path / "split"), 2, rank)) as f:
            phases[rank] = set(phase_windows(json.load(f)["traceEvents"]))
    assert {"step", "wait_rollout", "update_actor"} <= phases[0] and "gen" not in phases[0], phases[0]
    for rank in (2, 3):  # the rollout ranks: the generation and the rule's scoring
        assert {"step", "gen", "reward"} <= phases[rank] and "update_actor" not in phases[rank], phases[rank]
    assert not any(k.startswith("perf/gpu_busy") for k in split[2])  # on CUDA only


def test_split_moe_equals_colocated(tmp_path):
    """model=tiny_moe (parallel.ep=1) on split placement, 2 ranks (1 train + 1 rollout: the router and every
    expert cross whole, replicated tensors of the transfer) against colocated at world size 1 (in this
    process): every non-timing metric equal, the router's load statistics included."""
    from trainer_jobs import run_job

    job = [*RUN, "model=tiny_moe", "trainer.total_steps=2", "trainer.save_freq=0"]
    run_job(job, str(tmp_path / "colocated"))
    colocated = _metrics(tmp_path / "colocated")
    out = tmp_path / "split"
    run_torchrun(
        "-m", 2, ["engine.train", f"trainer.output_dir={out}", *job, *SPLIT, "placement.rollout_ranks=1"]
    )
    split = _metrics(out)
    assert sorted(split) == [1, 2]
    for step, row in split.items():
        assert "actor/moe_load_imbalance" in row, step
        assert _comparable(row) == _comparable(colocated[step]), step


MULTI_TURN = [  # tests/engine/test_multi_turn.py's calculator job, shortened
    *CALCULATOR_TASK,
    "rollout.multi_turn.max_tool_result_chars=4",  # the calculator's error messages fit as a tool turn
    "rollout.temperature=2.0",
    "data.batch_size=8",
    "rollout.n=8",
    "trainer.micro_batch_size=64",
    "optim.lr=5e-2",  # the reward below teaches a random model to open with the call's `#` within a step
    "trainer.total_steps=3",
    "trainer.test_freq=3",
    "rollout.val_n=2",
    "trainer.seed=1",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "trainer.plot=false",
]


CALLS_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    # a tool call (a turn opening with `#`), then the episode's turns and length (reads whole episodes)
    return 2.0 * solution_str.startswith("#") + 0.1 * len(extra_info["turns"]) + 0.01 * len(solution_str)
"""


def test_split_multi_turn_calculator_equals_colocated(tmp_path):
    """Multi-turn episodes with the calculator on split placement: 2 ranks (1 train + 1 rollout, which runs
    the episode loop, the tools and the scoring, and sends the response ids with the tool tokens inside, the
    mask with 0 on them, the log-probs and the `multi_turn/*` counts) against colocated at world size 1 (in
    this process); every non-timing metric equal (`multi_turn/tool_s` is seconds), validation on whole
    episodes included."""
    from trainer_jobs import run_job

    val = write_embedded_dataset(str(tmp_path / "val"), "calculator", 4, 1, seed=7, split="val")
    fn = tmp_path / "calls_reward.py"
    fn.write_text(CALLS_REWARD)
    job = [*MULTI_TURN, f"data.val_files=[{val}]", f"reward.fn={fn}:score"]
    run_job(job, str(tmp_path / "colocated"))
    colocated = _metrics(tmp_path / "colocated")
    out = tmp_path / "split"
    run_torchrun(
        "-m", 2, ["engine.train", f"trainer.output_dir={out}", *job, *SPLIT, "placement.rollout_ranks=1"]
    )
    split = _metrics(out)
    assert sorted(split) == [1, 2, 3]
    for step, row in split.items():
        same = {k: v for k, v in _comparable(row).items() if k != "multi_turn/tool_s"}
        assert same == {k: v for k, v in _comparable(colocated[step]).items() if k != "multi_turn/tool_s"}, (
            step
        )
        assert row["multi_turn/episodes"] == 64.0 and row["multi_turn/tool_calls_mean"] > 0, step
    assert split[3]["multi_turn/turns_mean"] > 1  # tool turns inside the responses, assistant turns after
    assert "val/reward_mean" in split[3] and "val/embedded/calculator/mean@2" in split[3]


@pytest.mark.vllm
def test_split_with_vllm_equals_colocated_with_vllm_on_gpus(tmp_path):
    """GPU + vLLM, 1 + 1 GPUs against 1 GPU: split placement (rank 0 trains, rank 1 generates with
    rollout.backend=vllm; rank 0 starts an idle vLLM engine, since vLLM's start spans every rank) gives the
    colocated vLLM run's metrics. Both generate one training replica's prompts in one share with the same seeds;
    float32 on both sides, compared to rel 1e-5 (vLLM on another GPU of the same kind)."""
    import torch

    from engine.rollout.vllm_backend import import_vllm

    import_vllm()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    gpu = ["cluster=single_gpu", "rollout.backend=vllm", "model.dtype=float32", "trainer.save_freq=0"]
    gpu += ["trainer.total_steps=2", *_validation(tmp_path, 2)]
    colocated = _train(1, tmp_path / "colocated", *gpu)
    split = _train(2, tmp_path / "split", *gpu, "placement.mode=split", "placement.rollout_ranks=1")
    assert sorted(split) == [1, 2]
    for step, row in split.items():
        assert _comparable(row) == pytest.approx(_comparable(colocated[step]), rel=1e-5), step


LEARN = [  # tests/engine/learning_script.py's settings for the embedded `target` task at DP=2, seed 2
    "data.embedded_task=target",
    "data.embedded_digits=2",
    "rollout.max_new_tokens=3",
    "data.batch_size=16",
    "rollout.n=8",
    "trainer.micro_batch_size=32",
    "trainer.max_tokens_per_micro_batch=256",
    "algorithm.ppo_epochs=2",
    "algorithm.num_mini_batches=2",
    "optim.lr=5e-3",
    "trainer.seed=2",
    "trainer.total_steps=40",
    "trainer.save_freq=0",
]


def test_one_step_off_policy_records_staleness_and_learns_the_embedded_task(tmp_path):
    """3 ranks, trainer.off_policy_steps=1 with TIS: step 1 trains on its own weights' responses, every later
    step on the previous step's (staleness 1 on every row); the last step sends no weights; the mean reward
    of the last 10 of 40 steps beats the first 10 by the margin of tests/engine/test_trainer_learning.py."""
    off_policy = ["placement.mode=split", "placement.rollout_ranks=1", "trainer.off_policy_steps=1"]
    validation = _validation(tmp_path, 13)  # after steps 13, 26, 39 (whose weights go out only for it), 40
    rows = _train(3, tmp_path / "off", *LEARN, *off_policy, "algorithm.tis_cap=2", *validation)
    assert sorted(rows) == list(range(1, 41))
    assert [s for s in rows if "val/reward_mean" in rows[s]] == [13, 26, 39, 40]
    assert [rows[s]["rollout/staleness_max"] for s in (1, 2, 40)] == [0.0, 1.0, 1.0]
    assert rows[2]["rollout/staleness_mean"] == 1.0
    # the rollout-vs-training gap: float noise on-policy, the update's change from step 2 on
    assert abs(rows[1]["actor/rollout_kl"]) < 1e-6 and abs(rows[2]["actor/rollout_kl"]) > 1e-4
    assert 0 < rows[2]["actor/tis_weight"] <= 2.0
    assert "timing/weight_transfer" in rows[39] and "timing/weight_transfer" not in rows[40]
    rewards = [rows[s]["reward/mean"] for s in sorted(rows)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.02, (first, last)


def test_one_step_off_policy_resume_regenerates_the_batch_in_flight_and_says_so(tmp_path):
    """2 ranks (1 train + 1 rollout) one step off policy, SIGKILLed after step 2's checkpoint while the batch of
    step 3 or 4 is generated, resumed (trainer.resume=auto): the checkpoint holds no batch in flight, so step 3's
    is regenerated with the checkpoint's weights (staleness 0, the rollout's log-probs are the update's up to
    float noise, as on step 1), step 4 is one step off policy again, and the log says which it is."""
    off_policy = [*SPLIT, "placement.rollout_ranks=1", "trainer.off_policy_steps=1", "algorithm.tis_cap=2"]
    out = tmp_path / "off"
    _killed_in_step_3(out, *off_policy, nproc=2)
    assert sorted(_metrics(out)) in ([1, 2], [1, 2, 3])  # killed inside step 3 or 4
    output = run_torchrun(
        "-m", 2, ["engine.train", f"trainer.output_dir={out}", *RUN, *off_policy, "trainer.resume=auto"]
    )
    rows = _metrics(out)
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["rollout/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    assert abs(rows[3]["actor/rollout_kl"]) < 1e-6 and abs(rows[4]["actor/rollout_kl"]) > 1e-6
    assert (
        "the batch of step 3 that was in flight is not in the checkpoint; the rollout ranks regenerate"
        in (output)
    ), output[-6000:]


def test_one_step_off_policy_kl_in_the_reward_is_the_policys_not_the_rollouts(tmp_path):
    """PPO's KL in the reward one step off policy: step 2 trains on responses of the initial weights, which
    the reference copies, so a KL built on the rollout's log-probs would be ~0 (it was: the old-log-prob
    forward was skipped and the penalty lagged the policy by a step). It must be KL(policy after step 1 ||
    reference), which the rollout-vs-training gap measures independently on the same tokens (the rollout engine
    ran the initial weights; equal-length responses make the two means the same average; k1 estimator).
    Also: perf/tokens_per_s_per_gpu counts the rollout rank's GPU (it counted the training ranks only)."""
    off_policy = [*SPLIT, "placement.rollout_ranks=1", "trainer.off_policy_steps=1", "algorithm.tis_cap=2"]
    ppo = ["algorithm=ppo", "algorithm.kl_estimator=k1", "rollout.ignore_eos=true", "optim.lr=1e-2"]
    rows = _train(2, tmp_path, *off_policy, *ppo, "trainer.total_steps=2", "trainer.save_freq=0")
    assert rows[2]["rollout/staleness_max"] == 1.0
    penalty, gap = rows[2]["actor/reward_kl_penalty"], rows[2]["actor/rollout_kl"]
    assert abs(penalty) > 1e-4, rows[2]
    assert abs(penalty + gap) < 1e-6 + 1e-4 * abs(penalty), (penalty, gap)
    # tokens/s per GPU of the job, the rollout rank's too (it divided by the training ranks alone)
    per_gpu = rows[2]["perf/total_tokens"] / rows[2]["timing/step"] / 2
    assert rows[2]["perf/tokens_per_s_per_gpu"] == pytest.approx(per_gpu, rel=1e-6)


def test_ppo_critic_on_its_own_rank_equals_the_critic_on_the_actors_rank_and_resumes_after_sigkill(tmp_path):
    """PPO (GAE, KL in the reward): 3 ranks (1 actor + 1 critic + 1 rollout) against 2 ranks (1 trainer holding
    actor and critic + 1 rollout), which equals colocated (the tests above): every non-timing metric, the
    critic's included, is equal; the critic side's seconds arrive as timing/critic_update and timing/values,
    the actor's waits for it as timing/wait_critic. The 3-rank run saves step 2 (actor and critic ranks into
    one checkpoint), is SIGKILLed inside step 3 and resumed (trainer.resume=auto): steps 3 and 4 equal the
    uninterrupted run's too. A damaged critic shard makes its checkpoint unusable, as an actor's does."""
    ppo = ["algorithm=ppo", *SPLIT, "placement.rollout_ranks=1"]
    shared = _train(2, tmp_path / "shared", *ppo)
    out = tmp_path / "own"
    _killed_in_step_3(out, *ppo, "placement.critic_ranks=1")
    assert sorted(_metrics(out)) == [1, 2]  # killed inside step 3
    step_2 = os.path.join(out, "checkpoints", "global_step_2")
    assert sorted(os.listdir(step_2)) == ["meta.json", "rank_0.pt", "rank_1.pt"]  # the actor's, the critic's
    own = _train(3, out, *ppo, "placement.critic_ranks=1", "trainer.resume=auto")
    assert sorted(own) == [1, 2, 3, 4]
    for step, row in own.items():
        assert _comparable(row) == _comparable(shared[step]), step
        assert row["critic/grad_norm"] > 0 and "critic/vf_loss" in row, step
        for key in ("timing/critic_update", "timing/values", "timing/wait_critic"):
            assert row[key] >= 0, (step, key)
        assert "timing/update_critic" not in row, step

    root = os.path.join(out, "checkpoints")
    with open(os.path.join(root, "global_step_4", "meta.json")) as f:
        meta = json.load(f)
    assert meta["roles"] == ["actor", "critic"] and meta["layout"]["critic_ranks"]["world_size"] == 1
    with open(os.path.join(root, "global_step_4", "rank_1.pt"), "r+b") as f:
        f.truncate(100)
    skipped: list[str] = []
    assert latest_checkpoint(root, skipped) == os.path.join(root, "global_step_2")
    assert "rank_1.pt is truncated or corrupt" in skipped[0], skipped


def test_rollout_replicas_serve_training_replicas_whole_or_in_shares():
    """No processes: which prompts each rollout replica generates, and whom each training replica hears from."""
    fewer = SplitLayout(TrainLayout(tp=1, pp=1, dp=4), rollout_tp=1, rollout_ranks=2)  # ranks 4, 5
    assert [fewer.assignments(e) for e in range(2)] == [[(0, 0, 1), (2, 0, 1)], [(1, 0, 1), (3, 0, 1)]]
    assert [fewer.serving_ranks(d) for d in range(4)] == [[4], [5], [4], [5]]
    more = SplitLayout(TrainLayout(tp=2, pp=1, dp=2), rollout_tp=2, rollout_ranks=6)  # replicas at 4, 6, 8
    assert [more.assignments(e) for e in range(3)] == [[(0, 0, 2)], [(1, 0, 1)], [(0, 1, 2)]]
    assert [more.serving_ranks(d) for d in range(2)] == [[4, 8], [6]]
    assert more.replica_ranks(1) == [2, 3]
    # critic ranks sit between the actor's and the rollout ranks: actor 0-3, critic 4-7 (TP=2 x DP=2), rollout 8-9
    critic = SplitLayout(TrainLayout(tp=2, pp=1, dp=2), 1, 2, critic=TrainLayout(tp=2, pp=1, dp=2))
    assert critic.rollout_start == 8 and critic.world_size == 10
    assert [critic.critic_replica_ranks(d) for d in range(2)] == [[4, 5], [6, 7]]
    assert critic.is_critic_rank(4) and not critic.is_critic_rank(8) and critic.is_rollout_rank(8)
    assert critic.serving_ranks(1) == [9] and critic.rollout_coords(9) == (0, 1)
    # failure messages name the side and coordinates (parallel/arrival.py)
    names = [critic.describe_rank(r) for r in (3, 6, 9)]
    assert names == ["training rank 3 at TP 1, PP 0, DP 1", "critic rank 6 at TP 0, PP 0, DP 1"] + [
        "rollout rank 9 at rollout TP 0, DP 1"
    ]
