"""What the framework adapters (``lightning/``, ``fabric/``, ``accelerate/``, ``transformers/``, ``hydra/``) share:
the engine's owner, the strategy presets, the precision flag, the micro-batch check and the rule for a DeepSpeed
config's optimizer and scheduler sections. Nothing here imports a framework; the core never imports it."""
