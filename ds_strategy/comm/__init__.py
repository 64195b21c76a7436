"""Every collective ds_strategy issues: the engine's, with accounting, ZeRO++ quantised variants and the sequence
check; and, through one ``Collectives`` per process group (``group_collectives``), the model's own (``differentiable``:
Ulysses all-to-alls, tensor-parallel sums) and the checkpoints' (``objects``). Nothing outside this package calls
torch.distributed's collectives (``tests/architecture/test_no_raw_collectives.py``)."""
