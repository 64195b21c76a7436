"""The ZeRO engine: units of flat parameter buffers whose shard policy is the stage (see engine.py)."""
