"""Shared by the dataset preparation scripts: read a split of a Hugging Face dataset (the hub, or a local copy
laid out as the hub's dataset repository) and write rows in the common RLHF parquet schema.

The schema, as verl's `examples/data_preprocess/*.py` write it: `data_source` (str), `prompt` (list of
`{role, content}`), `ability` (str), `reward_model` (`{style, ground_truth}`), `extra_info` (dict).
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq


def read_split(source: str, hub_name: str, hub_config: str | None, local_dir: str, split: str) -> list[dict]:
    """Rows of `split`: from `source` (a local copy of the hub repository: `<source>/<local_dir>/<split>-*.parquet`)
    or, when `source` is empty, from the hub with `datasets.load_dataset(hub_name, hub_config)`."""
    if source:
        pattern = os.path.join(os.path.expanduser(source), local_dir, f"{split}-*.parquet")
        files = sorted(glob.glob(pattern))
        if not files:
            sys.exit(
                f"--source {source}: no file matches {pattern}; expected a copy of the hub repository "
                f"{hub_name} (e.g. `huggingface-cli download {hub_name} --repo-type dataset --local-dir DIR`)"
            )
        return [row for file in files for row in pq.read_table(file).to_pylist()]
    try:
        import datasets
    except ImportError:
        sys.exit("reading from the hub needs `pip install datasets`; or pass --source DIR (a local copy)")
    return list(datasets.load_dataset(hub_name, hub_config, split=split))


def write_rows(rows: Iterable[dict], path: str) -> int:
    """Write `rows` (dicts in the RLHF schema) to parquet at `path`; returns the row count."""
    rows = list(rows)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return len(rows)


def prepare(
    source: str,
    out: str,
    hub_name: str,
    hub_config: str | None,
    local_dir: str,
    make_row: Callable[[dict, str, int], dict],
) -> None:
    """Convert the train and test splits with `make_row(example, split, index)` into `<out>/{train,test}.parquet`."""
    out = os.path.expanduser(out)
    for split in ("train", "test"):
        rows = [
            make_row(example, split, i)
            for i, example in enumerate(read_split(source, hub_name, hub_config, local_dir, split))
        ]
        path = os.path.join(out, f"{split}.parquet")
        print(f"{split}: {write_rows(rows, path)} rows -> {path}")
