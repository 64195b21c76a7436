"""Migrating from DeepSpeed: its checkpoints, its accelerate YAML, the table of its keys for the docs.

Its JSON config is read by ``ds_strategy.config.deepspeed``; nothing here imports DeepSpeed.
"""
