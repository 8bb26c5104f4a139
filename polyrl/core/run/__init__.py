"""What a run leaves on disk: the run directory, checkpoints, export to Hugging Face format, the report.

- :mod:`.directory` — ``RunDir``: config.yaml, metrics.jsonl, TensorBoard events, checkpoints/.
- :mod:`.checkpoint` — DCP checkpoints published atomically, resume from the newest complete one.
- :mod:`.export` — a checkpoint as HF safetensors + config + tokenizer.
- :mod:`.report` — plots and a Markdown summary of a run directory.
- :mod:`.faults` — a fault of the machine mid-run (full or unwritable disk, device memory, ...) as one line.
"""
