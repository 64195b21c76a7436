"""``ZeroTrainer``: transformers' ``Trainer`` on ds_strategy's ZeRO engine, through a ``ZeroAccelerator``.

The switch from DeepSpeed is the class names: ``ZeroTrainer(model, args=ZeroTrainingArguments(..., deepspeed=
"ds_config.json"), ...)``, which needs nothing beyond the ``[transformers]`` extra (or ``zero_config=`` with a
DeepSpeed JSON, ZeroConfig fields or a ZeroConfig, or ``$DS_STRATEGY_CONFIG``; see :mod:`.trainer_config`).
transformers' own ``TrainingArguments(deepspeed=...)`` works too where the deepspeed package is installed (transformers
imports it to build those arguments); it trains the same, the ZeroTrainer undoing the DeepSpeed set-up it started.
The Trainer's loop runs unchanged: forward, backward, accumulation, clipping, the optimizer step and evaluation reach
the engine through the accelerator. What changes is what the Trainer would do with a module whose parameters are
shards:

- ``save_model`` gathers the model unit by unit into rank 0's state dict, in the dtypes the model was given in
  (DDP's rule, see ``ZeroAccelerator.consolidated_state_dict``), and writes it with ``save_pretrained``: a directory
  ``from_pretrained`` loads (for a PEFT model, its adapters only, as Trainer saves them);
- ``checkpoint-N/`` holds that directory plus ``zero_checkpoint/``, the sharded model, optimizer and loss scale
  each rank writes its share of (:mod:`ds_strategy.checkpoint`), beside Trainer's own scheduler, RNG and trainer
  state files; resuming reads the sharded checkpoint after ``prepare``, at any world size or ZeRO stage;
- ``load_best_model_at_end`` reads the best checkpoint's weights into the shards.
- ``ZeroTrainer(..., state_dict_type="full")`` (FSDP's choice, :mod:`ds_strategy.adapters.state_dict_type`) makes
  ``checkpoint-N/`` a DDP Trainer's: the gathered weights and the whole optimizer state gathered onto rank 0 as
  ``optimizer.pt``, no ``zero_checkpoint/``; resuming reads such a checkpoint, or a DDP Trainer's, into the shards at
  any world size or stage (the weights before ``prepare``, as Trainer loads them, the optimizer after).
  ``save_only_model=True`` leaves the optimizer out under either choice, as Trainer does.
- ``generate`` at stage 3 gathers each unit for each token's forward through the engine's hooks (also inside TRL's
  ``unwrap_model_for_generation``), or each unit once for a ``gathered_for_generation()`` block;
- a model from :func:`.sharded_from_pretrained` stays on the meta device until ``prepare``, which reads its weights
  sharded;
- other models the trainer prepares for evaluation (TRL's reference and reward models) are sharded at stage 3 by
  engines without an optimizer, and kept whole below it, as TRL's ``prepare_deepspeed`` does (see
  :mod:`.frozen_models`);
- with ``sequence_parallel_size > 1`` (or ``TrainingArguments.parallelism_config.sp_size``) each rank of a
  DeepSpeed-Ulysses group trains on its slice of the group's batch, and the group's loss is logged and
  differentiated (see :mod:`.sequence_parallel`).

``ZeroTrainerMixin`` carries all of it, so any Trainer subclass composes: ``class MyTrainer(ZeroTrainerMixin,
MyBaseTrainer)``; ``ZeroSFTTrainer`` is TRL's ``SFTTrainer`` composed so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from transformers.trainer_pt_utils import reissue_pt_warnings

from .. import checkpoint
from ..accelerate import ZeroAccelerator
from ..accelerate.checkpointing import SHARDED_DIR
from ..adapters.state_dict_type import checked_state_dict_type
from ..checkpoint import CheckpointError
from ..comm.peer_failures import name_failed_peers_in
from ..config import ZeroConfig
from . import build_hook
from .frozen_models import TrainerAccelerator
from .sequence_parallel import combine_over_group, slice_for_rank
from .trainer_config import TrainerZeroConfig, detach_deepspeed, sequence_parallel_size, trainer_zero_config

logger = logging.getLogger(__name__)
SCHEDULER_NAME, OPTIMIZER_NAME = "scheduler.pt", "optimizer.pt"  # transformers.trainer's names for them


class ZeroTrainerMixin:
    """The ZeRO half of a ``ZeroTrainer``; put it before a ``transformers.Trainer`` subclass in the bases.

    ``zero_config``: a DeepSpeed JSON (path or dict), ZeroConfig fields, or a ZeroConfig; the default is
    ``TrainingArguments.deepspeed``, then ``$DS_STRATEGY_CONFIG``, then ZeroConfig's defaults (stage 2).
    """

    # Whether the trainer's loss is a sum over tokens that a Ulysses group can split (Note: [The Trainer's loss over
    # a sequence-parallel group]); a loss of whole sequences (DPO's) is not.
    supports_sequence_parallel = True

    def __init_subclass__(cls, **kwargs: Any):
        """Every Trainer built on this mixin names a rank that fails in its loops, whatever library collective (the
        Trainer's metric gathers and checkpoint exchanges, accelerate's) was waiting on it: Note: [Collectives a
        library issues] in ``ds_strategy.comm.peer_failures``."""
        super().__init_subclass__(**kwargs)
        name_failed_peers_in(cls, ("train", "evaluate", "predict"))

    def __init__(self, *args: Any, zero_config: Any = None, state_dict_type: str = "sharded", **kwargs: Any):
        self._zero_source = zero_config
        self.state_dict_type = checked_state_dict_type(state_dict_type, type(self).__name__)
        super().__init__(*args, **kwargs)

    # -- construction -----------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's own accelerator set-up, building a ``ZeroAccelerator`` where it builds an ``Accelerator``.

        Note: [Where the Trainer builds its accelerator]
        ``Trainer.create_accelerator_and_postprocess`` assembles some twenty accelerator arguments from
        ``TrainingArguments`` (data loader configuration, a one-step accumulation plugin, precision, dynamo) and
        calls the name ``Accelerator`` from its module's globals, with no hook to choose the class. That name is
        pointed at a ``ZeroAccelerator`` (a :class:`.TrainerAccelerator`, with this trainer's ZeroConfig) for the
        length of the call only, so the arguments stay exactly transformers' own, version by version.
        """
        from_args = detach_deepspeed(self.args)
        if from_args is not None and self._zero_source is not None:
            raise ValueError(
                "both TrainingArguments(deepspeed=...) and ZeroTrainer(zero_config=...) configure ZeRO; keep one"
            )
        _refuse_deepspeed_partitioned(self.model)
        self.zero_settings: TrainerZeroConfig = trainer_zero_config(
            from_args if from_args is not None else self._zero_source, self.args
        )
        _refuse_synced_reference(self.args, self.zero_settings.zero)
        self._refuse_unsliceable_loss()
        build = functools.partial(
            TrainerAccelerator,
            self.zero_settings.zero,
            trained_model=lambda: self.model,
            state_dict_type=self.state_dict_type,
        )
        with _trainer_accelerator_class(build):
            super().create_accelerator_and_postprocess()

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """``model_init()``, building sharded at stage 3 (Note: [Building sharded before the Trainer exists])."""
        with build_hook.armed_while(self.zero_settings.zero.stage >= 3):
            return super().call_model_init(trial)

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Not a model still on the meta device (``sharded_from_pretrained``): ``prepare`` materialises it, one unit
        at a time, where the engine places it."""
        if not any(p.is_meta for p in model.parameters()):
            super()._move_model_to_device(model, device)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The DeepSpeed config's ``optimizer`` section, when it has one, over the trainable parameters."""
        if self.optimizer is None and self.zero_settings.optimizer is not None:
            opt_model = self.model if model is None else model
            self.optimizer = self.zero_settings.build_optimizer([p for p in opt_model.parameters() if p.requires_grad])
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The DeepSpeed config's ``scheduler`` section, when it has one, its step counts filled from the run; it
        steps once per optimizer step, as DeepSpeed's engine steps it."""
        if self.lr_scheduler is None and self.zero_settings.scheduler is not None:
            optimizer = self.optimizer if optimizer is None else optimizer
            if isinstance(optimizer, AcceleratedOptimizer):
                optimizer = optimizer.optimizer
            self.lr_scheduler = self.zero_settings.build_scheduler(optimizer, self.args, num_training_steps)
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``. Refused after ``evaluate`` sharded a model built sharded without an optimizer (see
        Note: [Frozen models beside the trained one]): its flat buffers cannot take the optimizer's groups."""
        engine = self.zero_engine
        if engine is not None and engine.optimizer is None:
            raise RuntimeError(
                "the model was built sharded (stage 3) and evaluate()/predict() sharded it for inference before "
                "train(); train first and evaluate after, or build a new ZeroTrainer for training"
            )
        return super().train(*args, **kwargs)

    def _refuse_unsliceable_loss(self) -> None:
        sp = sequence_parallel_size(self.zero_settings.zero, self.args)
        if sp == 1:
            return
        if not self.supports_sequence_parallel:
            raise ValueError(
                f"sequence_parallel_size={sp} under {type(self).__name__}: its loss compares whole sequences, which "
                f"the ranks of a Ulysses group hold a slice each of; use ZeroTrainer or ZeroSFTTrainer, or 1"
            )
        if self.args.label_smoothing_factor:
            raise ValueError(
                f"label_smoothing_factor={self.args.label_smoothing_factor} with sequence_parallel_size={sp}: the "
                f"label smoother shifts labels within each rank's slice; use 0 (or sequence_parallel_size=1)"
            )

    # -- the loss ---------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The trainer's loss; under Ulysses over this rank's slice of the batch, combined over its group (Note:
        [The Trainer's loss over a sequence-parallel group])."""
        group = self._sequence_group()
        if group is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training and self.compute_metrics is not None:
            raise ValueError(
                "compute_metrics with sequence parallelism: each rank holds the logits of its slice of the sequence "
                "only; evaluate the loss (compute_metrics=None), or evaluate without sequence parallelism"
            )
        local = slice_for_rank(inputs, group)
        loss, outputs = super().compute_loss(model, local, True, num_items_in_batch)
        loss = combine_over_group(loss, local.get("shift_labels"), num_items_in_batch, group)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's; under Ulysses only with labels, whose loss ``compute_loss`` slices the batch for (without them
        Trainer calls the model on whole sequences, which Ulysses attention would take for slices)."""
        if self._sequence_group() is not None and inputs.get("labels") is None:
            raise ValueError(
                "prediction without labels under sequence parallelism: the model attends over a sequence sliced "
                "across the group, and only the loss path slices it; give labels (or evaluate without it)"
            )
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _sequence_group(self):
        """The Ulysses group of this rank, or None without sequence parallelism."""
        mesh = getattr(self.accelerator, "parallel_mesh", None)
        return mesh.sp_group if mesh is not None else None

    def get_total_train_batch_size(self, args) -> int:
        """Trainer's, counting each Ulysses group once: its ranks read one batch."""
        return super().get_total_train_batch_size(args) // sequence_parallel_size(self.zero_settings.zero, args)

    @property
    def zero_engine(self):
        """The engine sharding the trained model, once ``train`` (or ``evaluate``) prepared it; else None."""
        return self.accelerator.engine_of(self.model) if isinstance(self.accelerator, ZeroAccelerator) else None

    def gathered_for_generation(self) -> contextlib.AbstractContextManager:
        """``with trainer.gathered_for_generation(): trainer.model.generate(...)``: the model's units gathered once
        for the block rather than once per generated token (see ``ZeroEngine.gathered_parameters``; the whole model
        is held on every rank meanwhile). Every rank enters it. Without it ``generate`` works too, gathering each
        unit for each token's forward at one unit's memory."""
        engine = self.zero_engine
        return engine.gathered_parameters() if engine is not None else contextlib.nullcontext()

    # -- saving -----------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The gathered model, written by rank 0 with ``save_pretrained``; every rank must call it."""
        if self.zero_engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state_dict = self.accelerator.consolidated_state_dict(self.model, rank0_only=True)
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The sharded model and optimizer into ``output_dir/zero_checkpoint``, each rank its share; the scheduler
        as Trainer saves it. Trainer's own path would pickle rank 0's optimizer shard as the whole optimizer."""
        engine = self.zero_engine
        if engine is None or engine.optimizer is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.state_dict_type == "full":
            whole = self.optimizer.state_dict()  # a collective: rank 0 gets the whole state
            if self.args.should_save:
                torch.save(whole, os.path.join(output_dir, OPTIMIZER_NAME))
        else:
            checkpoint.save(Path(output_dir, SHARDED_DIR), engine.module, engine)
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught_warnings:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught_warnings)

    # -- resuming ---------------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """Before ``prepare``: nothing, for a checkpoint with a sharded part (read after ``prepare``, by
        ``_load_optimizer_and_scheduler``, without ever holding the whole model); else Trainer's load."""
        if Path(resume_from_checkpoint, SHARDED_DIR).is_dir():
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """After ``prepare``: the sharded model, optimizer and loss scale, then the scheduler."""
        engine = self.zero_engine
        if checkpoint_dir is None or engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        sharded = Path(checkpoint_dir, SHARDED_DIR)
        if not sharded.is_dir() and self.state_dict_type == "full":
            return super()._load_optimizer_and_scheduler(checkpoint_dir)  # the whole optimizer.pt, into the shards
        if not sharded.is_dir():
            raise CheckpointError(
                f"{checkpoint_dir} has no {SHARDED_DIR}/: it was not written by a sharded ZeroTrainer; resume from "
                f"its whole optimizer.pt with ZeroTrainer(state_dict_type='full'), or start from its weights "
                f"(ZeroTrainer(model=from_pretrained({checkpoint_dir!r})) without resume_from_checkpoint)"
            )
        checkpoint.load(sharded, engine.module, engine)
        scheduler_file = Path(checkpoint_dir, SCHEDULER_NAME)
        if scheduler_file.is_file():
            with warnings.catch_warnings(record=True) as caught_warnings:
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
            reissue_pt_warnings(caught_warnings)

    def _load_best_model(self) -> None:
        """The best checkpoint's sharded weights into the engine (optimizer state untouched)."""
        engine = self.zero_engine
        if engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        if not Path(best, SHARDED_DIR).is_dir():  # state_dict_type="full": the whole weights save_model wrote
            self.accelerator.load_pretrained(best, model=engine.module)
            return
        checkpoint.load(Path(best, SHARDED_DIR), engine.module, engine, load_optimizer=False)


class ZeroTrainer(ZeroTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training with ds_strategy's ZeRO; see the module docstring."""


@contextlib.contextmanager
def _trainer_accelerator_class(build: Any):
    """See Note: [Where the Trainer builds its accelerator]."""
    import transformers.trainer as trainer_module

    original = trainer_module.Accelerator
    trainer_module.Accelerator = build
    try:
        yield
    finally:
        trainer_module.Accelerator = original


def _refuse_synced_reference(args: Any, zero: ZeroConfig) -> None:
    """TRL's ``sync_ref_model`` mixes the trained parameters into the reference model's in place, through
    ``param.data``; at stage 3 both are empty views between forwards, so the mix would silently do nothing."""
    if getattr(args, "sync_ref_model", False) and zero.plan.partitions_parameters:
        raise ValueError(
            f"sync_ref_model=True needs whole parameters, but ZeRO stage {zero.stage} partitions them; use stage "
            f"1 or 2 (the reference model is then kept whole on every rank), or sync_ref_model=False"
        )


def _refuse_deepspeed_partitioned(model: torch.nn.Module | None) -> None:
    """A model DeepSpeed's ``zero.Init`` partitioned (built under a stage-3 ``TrainingArguments(deepspeed=...)``
    before ``ds_strategy.transformers`` was imported, or inside ``building_whole()``); this engine cannot shard it
    again."""
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(
            "the model's parameters were partitioned by deepspeed.zero.Init: it was built under a stage-3 "
            "TrainingArguments(deepspeed=...) before ds_strategy.transformers was imported. Import "
            "ds_strategy.transformers first: from_pretrained/from_config then build the model for the ZeroTrainer"
        )
