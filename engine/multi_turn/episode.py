"""The episode loop: multi-turn rollouts with tool calls over the `RolloutEngine` interface, on token ids.

One `EpisodeRunner.run` call rolls out `sampling.n` episodes per prompt:
- turn 1 is an ordinary `generate` of the prompts (n samples each); turn k > 1 generates one continuation per
  live episode, whose prompt is the episode's ids so far (prompt, then every earlier turn);
- the ids an assistant turn generated are appended verbatim (mask 1, with their rollout log-probs); their text
  (special tokens skipped) goes to the tool-call parser (engine/multi_turn/parsers.py);
- a turn that holds calls continues the episode: the calls of all episodes run concurrently
  (engine/multi_turn/tools.py), and their results are rendered as a tool turn by the chat template
  (engine/multi_turn/render.py) and appended (mask 0, log-prob 0): tool tokens are context, never trained. A
  turn cut by its token limit gets the template's end of turn (the stop token included) in front of the tool
  turn, as context too (with `hermes` such a turn rarely holds a whole call; `compact` calls fit in a few);
- an episode ends after a turn without calls, after `max_turns` assistant turns, or when the next tool turn
  would not leave room for one more token within `max_total_tokens`.
  Episodes therefore always end with an assistant turn, and the response's length is one past its last
  mask-1 position (engine/step/batch.py `response_lengths`).
All episodes of a call advance together, turn by turn; finished ones drop out. Each turn's limit is
rollout.max_new_tokens, cut to what is left of max_total_tokens.

KV cache across turns: the turns of one call run inside `RolloutEngine.hold(max_len)` (max_len: the longest
prompt + max_total_tokens + one turn), and turn k > 1 goes through `generate_continued`, naming each
episode's row of the turn before. The native engine keeps each row's K/V between turns and prefills only the
tool turn (and the last generated token), falling back to a full prefill where the rows do not fit its cache
at once (engine/rollout/native.py); vLLM keeps the episode's blocks through prefix caching while it stays
awake.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from engine.config import MultiTurnConfig
from engine.multi_turn.parsers import get_tool_parser
from engine.multi_turn.render import TurnRenderer
from engine.multi_turn.tools import Tool, ToolCall, call_tools
from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams


@dataclass
class Episode:
    """What happened in one row's episode after its prompt."""

    turns: list[dict] = field(default_factory=list)
    """{"role": "assistant" | "tool", "content": text} per turn in order (assistant text with special tokens
    skipped, tool results as rendered); an assistant turn whose calls ran also has "tool_calls": [{"name",
    "arguments"}] (a malformed call: name "" or its name, with "error"). What a reward function reads as
    extra_info["turns"]."""
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    """Calls that returned an error message (unknown tool, malformed call, failure, time limit)."""

    @property
    def num_assistant_turns(self) -> int:
        return sum(t["role"] == "assistant" for t in self.turns)


def _turn_seed(seed: int, turn: int) -> int:
    return (seed + turn * 1_000_003) % (2**62)


class EpisodeRunner:
    """Rolls out multi-turn episodes with `tools` (name -> Tool) on any rollout engine.

    `max_context`: the model's max_position_embeddings (the episode's prompt + response + one turn must fit);
    `pad_id` pads the responses."""

    def __init__(
        self, cfg: MultiTurnConfig, tokenizer, tools: dict[str, Tool], max_context: int, pad_id: int
    ):
        self.cfg, self.tokenizer, self.tools = cfg, tokenizer, tools
        self.parser = get_tool_parser(cfg.tool_format)
        self.renderer = TurnRenderer(tokenizer)
        self.max_context, self.pad_id = max_context, pad_id
        self.last_stats: dict[str, float] = {}

    @property
    def width(self) -> int:
        """Columns of the response tensors: max_total_tokens."""
        return self.cfg.max_total_tokens

    def _tools_of(self, names: list[str] | None) -> list[Tool]:
        if not names:
            return list(self.tools.values())
        return [self.tools[name] for name in names]

    def run(
        self,
        engine: RolloutEngine,
        prompts: list[list[int]],
        sampling: SamplingParams,
        tool_names: list[list[str] | None] | None = None,
    ) -> RolloutOutput:
        """`sampling.n` episodes per prompt, rows as `generate` orders them; `tool_names[p]`: the tools prompt
        p's episodes may call (None or empty: all). The output is `max_total_tokens` wide, with `episodes`."""
        n, budget = sampling.n, self.cfg.max_total_tokens
        per_turn = min(sampling.max_new_tokens, budget)
        longest = max((len(p) for p in prompts), default=0)
        if longest + budget + per_turn > self.max_context:
            raise ValueError(
                f"a prompt of {longest} tokens + rollout.multi_turn.max_total_tokens={budget} + one turn of "
                f"{per_turn} tokens exceeds model.max_position_embeddings={self.max_context}; lower "
                "data.max_prompt_len, rollout.multi_turn.max_total_tokens or rollout.max_new_tokens"
            )
        num_rows = len(prompts) * n
        row_tools = [self._tools_of(tool_names[r // n] if tool_names else None) for r in range(num_rows)]
        ids: list[list[int]] = [[] for _ in range(num_rows)]
        mask: list[list[float]] = [[] for _ in range(num_rows)]
        logp: list[list[float]] = [[] for _ in range(num_rows)]
        reasons = ["length"] * num_rows
        episodes = [Episode() for _ in range(num_rows)]
        live = list(range(num_rows))
        stats = {"turns": 0.0, "tool_s": 0.0}
        turn, previous = 0, list(range(num_rows))  # previous[i]: live row i's row in the last call's output
        with engine.hold(max_len=longest + budget + per_turn):  # all rows decode to the longest's end
            while live:
                if turn == 0:
                    turn_prompts = prompts
                    turn_sampling = replace(sampling, max_new_tokens=per_turn, max_new_tokens_per_prompt=())
                else:
                    limits = [min(per_turn, budget - len(ids[r])) for r in live]
                    turn_prompts = [prompts[r // n] + ids[r] for r in live]
                    turn_sampling = replace(
                        sampling,
                        n=1,
                        max_new_tokens=max(limits),
                        max_new_tokens_per_prompt=tuple(limits) if min(limits) < max(limits) else (),
                        seed=_turn_seed(sampling.seed, turn),
                    )
                if turn == 0:
                    out = engine.generate(turn_prompts, turn_sampling)
                else:
                    out = engine.generate_continued(turn_prompts, turn_sampling, [previous[r] for r in live])
                previous = {r: i for i, r in enumerate(live)}
                stats["turns"] += 1
                pending = self._append_turn(out, live, ids, mask, logp, reasons, episodes, row_tools)
                start = time.perf_counter()
                results = call_tools(
                    [calls for _, calls in pending],
                    [{t.name: t for t in row_tools[r]} for r, _ in pending],
                    self.cfg.tool_timeout_s,
                )
                stats["tool_s"] += time.perf_counter() - start
                live = self._append_tool_turns(pending, results, ids, mask, logp, reasons, episodes)
                turn += 1
        self.last_stats = _episode_stats(episodes, stats)
        return self._output(ids, mask, logp, reasons, episodes, sampling.log_probs)

    def _append_turn(self, out, live, ids, mask, logp, reasons, episodes, row_tools) -> list:
        """Append each live row's generated ids; return (row, calls) of the rows whose episode goes on."""
        pending = []
        lengths = out.response_mask.sum(-1).long().tolist()
        for i, r in enumerate(live):
            length = lengths[i]
            new = out.response_ids[i, :length].tolist()
            ids[r] += new
            mask[r] += [1.0] * length
            logp[r] += out.log_probs[i, :length].tolist() if out.log_probs is not None else [0.0] * length
            reasons[r] = out.finish_reasons[i]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            episodes[r].turns.append({"role": "assistant", "content": text})
            if episodes[r].num_assistant_turns >= self.cfg.max_turns:
                continue
            calls = self.parser(text, row_tools[r])
            if calls:
                episodes[r].turns[-1]["tool_calls"] = [_call_record(c) for c in calls]
                pending.append((r, calls))
        return pending

    def _append_tool_turns(self, pending, results, ids, mask, logp, reasons, episodes) -> list[int]:
        """Append the tool turns that fit; return the rows that continue."""
        live = []
        for (r, calls), row_results in zip(pending, results):
            texts = [cut_tool_result(text, self.cfg.max_tool_result_chars) for text, _ in row_results]
            turn_ids = self.renderer.tool_turn_ids(texts, stopped=reasons[r] == "stop")
            episode = episodes[r]
            episode.num_tool_calls += len(calls)
            episode.num_tool_errors += sum(not ok for _, ok in row_results)
            if len(ids[r]) + len(turn_ids) >= self.cfg.max_total_tokens:
                reasons[r] = "length"  # no room for the tool turn and one more assistant token
                continue
            ids[r] += turn_ids
            mask[r] += [0.0] * len(turn_ids)
            logp[r] += [0.0] * len(turn_ids)
            episode.turns += [{"role": "tool", "content": text} for text in texts]
            live.append(r)
        return live

    def _output(self, ids, mask, logp, reasons, episodes, with_log_probs: bool) -> RolloutOutput:
        rows, width = len(ids), self.cfg.max_total_tokens
        out_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        out_mask = torch.zeros(rows, width)
        out_logp = torch.zeros(rows, width)
        for r in range(rows):
            length = len(ids[r])
            out_ids[r, :length] = torch.tensor(ids[r], dtype=torch.long)
            out_mask[r, :length] = torch.tensor(mask[r])
            out_logp[r, :length] = torch.tensor(logp[r])
        return RolloutOutput(out_ids, out_mask, out_logp if with_log_probs else None, reasons, episodes)


def _call_record(call: ToolCall) -> dict:
    record = {"name": call.name, "arguments": call.args}
    return {**record, "error": call.error} if call.error else record


def cut_tool_result(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters: its start and its end, joined by a marker that says how many
    characters were cut (both ends matter: a program's output opens with what it computed, a traceback ends
    with the error). A limit too small for the marker and a character on each side keeps the end alone. The
    marker uses only characters the embedded character-level tokenizer knows."""
    if len(text) <= limit:
        return text
    num_cut = len(text) - limit
    while True:  # the marker's own length adds to the cut, and the cut's digits to the marker
        marker = f"\n... {num_cut} characters cut ...\n"
        if len(text) - (limit - len(marker)) == num_cut:
            break
        num_cut = len(text) - (limit - len(marker))
    keep = limit - len(marker)
    if keep < 2:
        return text[len(text) - limit :]
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def _episode_stats(episodes: list[Episode], stats: dict[str, float]) -> dict[str, float]:
    """Totals of one call: episodes, assistant turns, tool calls, failed tool calls, `generate` rounds and
    seconds spent in tools (engine/step/rollout.py turns a step's episodes into the `multi_turn/*` metrics)."""
    return {
        "episodes": float(len(episodes)),
        "turns": float(sum(e.num_assistant_turns for e in episodes)),
        "tool_calls": float(sum(e.num_tool_calls for e in episodes)),
        "tool_errors": float(sum(e.num_tool_errors for e in episodes)),
        "rounds": stats["turns"],
        "tool_s": round(stats["tool_s"], 3),
    }
