"""Multi-turn rollouts with tool calls (`rollout.multi_turn.*`): the episode loop over the rollout engine
(episode.py), tool-call formats (parsers.py), the rendering of tool turns as tokens (render.py), the tool
interface with its built-in tools (tools.py) and the Python sandbox (sandbox.py).

Episodes are built on token ids: what the model generated is appended verbatim, tool turns are tokenised
on their own, and nothing is ever re-tokenised. Off by default; the single-turn path does not import it.
"""
