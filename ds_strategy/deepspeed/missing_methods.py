"""DeepSpeed engine methods :class:`~.engine.DeepSpeedEngine` does not have, and names of the ``deepspeed`` module
``ds_strategy.deepspeed`` does not have, each with what to use instead: a script that reaches for one stops with an
``AttributeError`` saying so, never a silent no-op."""

from __future__ import annotations

_PIPELINE = "pipeline engines are not built by initialize; set pipeline_parallel_size in the config and train through "
_PIPELINE += "the Lightning or Fabric adapter (docs/pipeline.md)"

# DeepSpeed's name -> what to do here instead.
INSTEAD = {
    "train_batch": _PIPELINE,
    "eval_batch": _PIPELINE,
    "is_first_stage": _PIPELINE,
    "is_last_stage": _PIPELINE,
    "allreduce_gradients": "backward() reduces at the accumulation boundary by itself",
    "compile": "torch.compile the model before deepspeed.initialize; the engine shards the compiled model's module",
    "offload_states": "set offload_optimizer/offload_param in the config's zero_optimization section",
    "reload_states": "set offload_optimizer/offload_param in the config's zero_optimization section",
    "set_data_post_process_func": "post-process batches in your loop; the data loader is torch's DataLoader",
    "set_custom_curriculum_learning_schedule": "curriculum learning is not implemented; schedule the data yourself",
    "get_pld_theta": "progressive layer drop is not implemented",
    "flops_profiler": "use torch.profiler; the engine's hooks and collectives carry named ranges",
    "monitor": "log from your loop (TensorBoard, W&B); DeepSpeed's monitor is not implemented",
    "get_sequence_parallel_group": "set sequence_parallel_size in the config; Ulysses runs inside the model",
    "save_fp16_model_legacy": "save_16bit_model(save_dir, save_filename)",
    "load_universal_checkpoint": "load_checkpoint(load_dir) loads at any world size and stage already",
    "set_train_micro_batch_size": "set train_micro_batch_size_per_gpu in the config and build the engine again",
}


# The ``deepspeed`` module's names -> what to do here instead.
MODULE_INSTEAD = {
    "checkpointing": "torch.utils.checkpoint, or activation_checkpointing in the config",
    "pipe": "pipelining is configured by pipeline_parallel_size under the Lightning or Fabric adapter",
    "PipelineModule": "pipelining is configured by pipeline_parallel_size under the Lightning or Fabric adapter",
    "init_inference": "inference engines are not implemented; call the model (stage 3: under zero.GatheredParameters)",
    "ops": "DeepSpeed's kernels are not shipped; torch's optimizers (ds_strategy's CPU Adam when offloaded) step",
    "moe": "DeepSpeed's MoE layers are not implemented",
    "DeepSpeedConfig": "ds_strategy.config.load_config(path, deepspeed=True) reads a DeepSpeed JSON",
}


def missing_module_name_error(name: str) -> AttributeError:
    """The error for ``deepspeed.<name>``: what to use instead when it is one of DeepSpeed's."""
    hint = f" (DeepSpeed's, not implemented: {MODULE_INSTEAD[name]})" if name in MODULE_INSTEAD else ""
    return AttributeError(f"module 'ds_strategy.deepspeed' has no attribute {name!r}{hint}")


def missing_method_error(name: str) -> AttributeError | None:
    """The error for DeepSpeed's method ``name``, or None when DeepSpeed has no such method either."""
    if name not in INSTEAD:
        return None
    return AttributeError(
        f"DeepSpeedEngine.{name} is DeepSpeed's and not implemented by ds_strategy.deepspeed: {INSTEAD[name]}"
    )
