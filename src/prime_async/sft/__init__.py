"""`uv run sft`: supervised fine-tuning on the trainer's loop and backends (data -> packed batches)."""
