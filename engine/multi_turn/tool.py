"""The interface every tool of a multi-turn episode implements (engine/multi_turn/tools.py has the built-in
tools and the loader of user tools; engine/multi_turn/sandbox.py the Python executor)."""

from __future__ import annotations


class Tool:
    """One callable tool; subclasses set `name`, `description`, `parameters` and implement `call`."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}
    """JSON schema of the arguments object."""

    @property
    def schema(self) -> dict:
        """The OpenAI function schema (what `apply_chat_template(tools=...)` renders)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def call(self, args: dict) -> str:
        raise NotImplementedError
