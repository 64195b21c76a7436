"""Autotuning: find the fastest ZeRO configuration that fits a memory budget, by estimate and then by trial.

``Autotuner`` is the Python API (a LightningModule and DataModule factory in, the ranked trials out);
``ds-strategy autotune`` is the command. ``launch_ranks`` starts the fresh processes trials run in.
"""

from .export import deepspeed_dict
from .launcher import RanksOutcome, launch_ranks
from .space import Candidate, candidates
from .tuner import Autotuner, TrialResult, TuneResult

__all__ = [
    "Autotuner",
    "Candidate",
    "RanksOutcome",
    "TrialResult",
    "TuneResult",
    "candidates",
    "deepspeed_dict",
    "launch_ranks",
]
