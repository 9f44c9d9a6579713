"""Built-in tasks that ship with the engine, so a run needs no downloaded data or tokenizer.

`embedded` holds the default CPU job's task (copy digits); it writes ordinary RLHF parquet files and an
ordinary Hugging Face tokenizer directory, so the trainer reads them through the same code as real data.
"""
