"""Importing the user's code named in the config as `module:function` or `path/to/file.py:function`
(`reward.fn`, `rollout.multi_turn.tools`): one loader, so that both keys accept the same forms; each caller
words its own errors around what this raises."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType


def split_target(spec: str) -> tuple[str, str] | None:
    """('module or path', 'function') of `spec`, or None when it has no non-empty parts around a colon."""
    target, sep, name = spec.strip().rpartition(":")
    return (target, name) if sep and target and name else None


def is_file_target(target: str) -> bool:
    """Whether `target` names a Python file (a .py name or a path) rather than an importable module."""
    return target.endswith(".py") or "/" in target or os.sep in target


def import_target(target: str, prefix: str) -> ModuleType:
    """The module `target` names: a Python file, loaded under a stable name unique to its absolute path
    (`prefix` + a hash: two files called reward.py must not overwrite each other), or a module imported from
    sys.path. Raises FileNotFoundError for a missing file, else whatever importing it raises (a file that
    fails to import is not left in sys.modules)."""
    if not is_file_target(target):
        return importlib.import_module(target)
    path = os.path.abspath(target)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    name = prefix + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
