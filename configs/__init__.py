"""YAML presets shipped with ds_strategy (installed as ``ds_strategy.configs``, found by Hydra as
``pkg://ds_strategy.configs``): ``train.yaml`` for ``examples/train.py``, and ``accelerate/`` for
``ds-strategy launch``. The Hydra groups they use are registered by ``ds_strategy.hydra``."""
