"""Tool turns as token ids, rendered by the tokenizer's own chat template, without re-tokenising anything the
model generated.

The text a template puts between the end of an assistant turn and the next generation prompt is found by
difference: render a fixed conversation ending with an assistant message (A), and the same conversation with
the tool messages and the generation prompt appended (B); B must extend A, and B[len(A):] is the new text.
What the template writes after the assistant's content (e.g. `<|im_end|>\\n`, or `<eos>\\n` for the embedded
tokenizer) starts with the stop token the model generated itself; the rest of it (the newline) is added
in front. Only this new text is tokenised (no special tokens added), and its ids are appended to the episode.
The embedded character-level tokenizer has a chat template (engine/tasks/embedded.py), where a tool turn
renders as `\\nt:<result>\\na:`.
"""

from __future__ import annotations

_PROBE_USER = "probe question"
_PROBE_ANSWER = "probe answer"


class TurnRenderer:
    """Renders tool results as the ids of the turn(s) that follow an assistant turn ended by a stop token."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, which multi-turn "
                "rollouts render tool turns with. Fix: use a chat/instruct tokenizer or add a chat_template"
            )
        self.tokenizer = tokenizer
        self._base = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ANSWER},
        ]
        base_text = self._render(self._base, generation_prompt=False)
        end = base_text.rfind(_PROBE_ANSWER)
        if end < 0:
            raise ValueError("the chat template does not render an assistant message's content verbatim")
        tail = base_text[end + len(_PROBE_ANSWER) :]
        eos = tokenizer.eos_token or ""
        # a generated stop token is the start of this tail; what follows it is ours to add (all of it after a
        # turn cut by its token limit)
        self._after_stop = tail[len(eos) :] if eos and tail.startswith(eos) else tail
        self._after_cut = tail
        self._base_text = base_text

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def tool_turn_text(self, results: list[str], stopped: bool = True) -> str:
        """The text appended after an assistant turn (`stopped`: ended by a stop token; else cut by its limit):
        the template's end of that turn, the tool messages (one per result, in call order) and the next
        generation prompt."""
        messages = self._base + [{"role": "tool", "content": r} for r in results]
        text = self._render(messages, generation_prompt=True)
        if not text.startswith(self._base_text):
            raise ValueError(
                "the chat template renders an earlier assistant turn differently once tool messages follow it, "
                "so a tool turn cannot be appended to the generated ids; multi-turn needs a template whose "
                "history does not change as the conversation grows"
            )
        return (self._after_stop if stopped else self._after_cut) + text[len(self._base_text) :]

    def tool_turn_ids(self, results: list[str], stopped: bool = True) -> list[int]:
        """Token ids of `tool_turn_text(results, stopped)`, tokenised on their own."""
        text = self.tool_turn_text(results, stopped)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
