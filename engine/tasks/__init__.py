"""Built-in tasks that ship with the engine, so a run needs no downloaded data or tokenizer.

`embedded` holds the default CPU job's task (copy digits); it writes ordinary RLHF parquet files and an
ordinary Hugging Face tokenizer directory, so the trainer reads them through the same code as real data.
"""

from engine.tasks.embedded import (
    EMBEDDED_TASKS,
    EMBEDDED_VOCAB,
    EmbeddedJob,
    build_embedded_tokenizer,
    embedded_prompt,
    prepare_embedded_job,
    write_embedded_dataset,
)

__all__ = [
    "EMBEDDED_TASKS",
    "EMBEDDED_VOCAB",
    "EmbeddedJob",
    "build_embedded_tokenizer",
    "embedded_prompt",
    "prepare_embedded_job",
    "write_embedded_dataset",
]
