"""The engine hands megatron-core its process groups explicitly (no processes; a source scan with `ast`).

megatron 0.16 falls back to its global parallel_state groups wherever a group is not passed. Outside
`parallel/` (which creates the groups) the package must neither read parallel_state nor make a megatron
call that takes a group without passing one, so that a role can run on a subset of the ranks. The
behavioural check is tests/parallel/model_parity_script.py, which runs with megatron's groups destroyed.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCANNED = ("engine", "algorithms")

NEEDS_PG_COLLECTION = ("GPTModel", "DistributedDataParallel", "get_megatron_optimizer")
"""megatron constructors that read the global groups unless given `pg_collection=`."""
NEEDS_GROUP_SUFFIXES = ("_tensor_model_parallel_region", "_sequence_parallel_region")
"""megatron's TP mappings (tensor_parallel/mappings.py) read the global TP group unless given `group=`."""
NO_GROUP_ARGUMENT = ("vocab_parallel_cross_entropy",)
"""megatron functions that take no group at all in 0.16 (they always use the global TP group)."""


def _files() -> list[str]:
    out = []
    for pkg in SCANNED:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def global_group_uses(source: str) -> list[str]:
    """Each place in `source` that reads megatron's global groups, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module.startswith("megatron.core.parallel_state") or (
                node.module == "megatron.core" and "parallel_state" in names
            ):
                found.append(f"{node.lineno}: imports megatron's parallel_state")
        elif isinstance(node, ast.Import):
            if any(a.name.startswith("megatron.core.parallel_state") for a in node.names):
                found.append(f"{node.lineno}: imports megatron's parallel_state")
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            keywords = {k.arg for k in node.keywords}
            if name in NEEDS_PG_COLLECTION and "pg_collection" not in keywords:
                found.append(f"{node.lineno}: {name}(...) without pg_collection=")
            elif name.endswith(NEEDS_GROUP_SUFFIXES) and "group" not in keywords and len(node.args) < 2:
                found.append(f"{node.lineno}: {name}(...) without a group")
            elif name in NO_GROUP_ARGUMENT:
                found.append(f"{node.lineno}: {name}(...) uses megatron's global TP group")
            elif name == "get_forward_backward_func" and not (node.args or node.keywords):
                found.append(f"{node.lineno}: get_forward_backward_func() picks the schedule from globals")
    return found


def test_no_megatron_global_groups_outside_parallel():
    offenders = []
    for path in _files():
        with open(path, encoding="utf-8") as f:
            offenders += [f"{os.path.relpath(path, ROOT)}:{u}" for u in global_group_uses(f.read())]
    assert not offenders, "megatron's global process groups read outside parallel/:\n" + "\n".join(offenders)


def test_the_scan_finds_each_kind_of_global_read():
    source = """
from megatron.core import parallel_state
import megatron.core.parallel_state
first = parallel_state.is_pipeline_first_stage()
m = GPTModel(config=c)
d = DistributedDataParallel(config=c, module=m, pg_collection=pgs)
reduce_from_tensor_model_parallel_region(x)
gather_from_sequence_parallel_region(x, group=g)
vocab_parallel_cross_entropy(logits, target)
get_forward_backward_func()
get_forward_backward_func(pp_size=2, vp_size=None)
"""
    uses = global_group_uses(source)
    assert [u.split(":")[0] for u in uses] == ["2", "3", "5", "7", "9", "10"], uses
