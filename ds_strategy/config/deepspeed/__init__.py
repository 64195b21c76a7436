"""A DeepSpeed JSON config read with DeepSpeed's meaning: one rule per key DeepSpeed accepts (``key_tables``,
``rule_kinds``), the translation into a ZeroConfig (``translate``), the ``optimizer``/``scheduler`` sections
(``optimizer_section``) and DeepSpeed's LR schedules they may name (``lr_schedules``).
Nothing here imports DeepSpeed.
"""
