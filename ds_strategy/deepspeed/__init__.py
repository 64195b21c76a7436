"""Migrating from DeepSpeed: its JSON's rule tables, its optimizer and scheduler sections, its checkpoints.

``ds_strategy.deepspeed_config`` reads a DeepSpeed config with these tables; nothing here imports DeepSpeed.
"""
