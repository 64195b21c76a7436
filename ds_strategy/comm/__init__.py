"""Every collective ds_strategy issues: the engine's, with accounting, ZeRO++ quantised variants and the sequence
check; the model's own (``differentiable``: Ulysses all-to-alls, tensor-parallel sums) and the checkpoints'
(``objects``), through the mesh's ``Collectives`` or one made for a bare group (``group_collectives``). Nothing outside
this package calls torch.distributed's collectives (``tests/architecture/test_no_raw_collectives.py``)."""
