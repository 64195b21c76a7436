"""Sharded checkpoints of pipeline-parallel training on real gloo ranks, saved at one (pp, dp) layout and loaded
at others.

Every layout trains the same seeded model (``pipeline_runs``) on the same global batches with AdamW; a pp=1 layout
is a plain engine driven by ``loss.backward()`` (its hooks reduce the gradients), a pp>1 one the
``PipelineRunner``. A job is one ``(what, layout)`` step run by every rank of the world in turn; each returns
what the test compares: the losses of the steps trained after saving or loading and, for a save, this rank's
parameters and optimizer state at the moment of saving (whole, at dp=1) to compare with the consolidated file.
"""

import torch
from pipeline_runs import MODELS, batches, build_pipeline, full_output, loss_fn, mean_over_dp, optimizer_for

from ds_strategy.checkpoint import load, save
from ds_strategy.checkpoint.rank_state import saved_elsewhere, stored_names
from ds_strategy.compose import build_mesh, compose_model
from ds_strategy.config import ZeroConfig

GLOBAL_BATCH = 4
SAVED_AT, STEPS = 2, 4  # save after step 2 of 4; the steps after are what resuming must reproduce


def build(model_name: str, pp: int, tp: int = 1, stage: int = 1, schedule: str = "1f1b"):
    """(model, engine, runner or None, mesh) at this layout; at pp=1 the model is whole and trains by hooks."""
    fields = dict(stage=stage, pipeline_parallel_size=pp, tensor_parallel_size=tp, pipeline_schedule=schedule)
    if tp > 1:
        fields["tensor_parallel_plan"] = "auto"
    if pp > 1:
        return build_pipeline(model_name, "adamw", **fields)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = ZeroConfig(**fields)
    model = MODELS[model_name](4)
    mesh = build_mesh(config, "cpu")
    opt = optimizer_for(model, "adamw")
    composed = compose_model(model, config, mesh=mesh, device=torch.device("cpu"), log=lambda _: None, optimizers=[opt])
    return model, composed.engine, None, mesh


def train(model_name: str, model, engine, runner, mesh, first: int, last: int) -> list[float]:
    """Optimizer steps ``first .. last - 1`` on this rank's data-parallel slice of each global batch."""
    per_rank = GLOBAL_BATCH // mesh.dp_size
    lo = mesh.dp_rank * per_rank
    losses = []
    for x, y in batches(model_name, last, GLOBAL_BATCH)[first:last]:
        x, y = x[lo : lo + per_rank], y[lo : lo + per_rank]
        if runner is not None:
            loss = runner.train_step(x, y, loss_fn)
        else:
            loss = loss_fn(full_output(model_name, model, x), y)
            loss.backward()
        engine.step()
        losses.append(mean_over_dp(loss, mesh))
    return losses


def whole_state(engine) -> dict:
    """This rank's parameters and elementwise and scalar optimizer state by stored name (tied copies under their
    canonical name, separately), read straight from the engine; needs dp=1, where the master is whole."""
    params = {k: v for k, v in engine.full_state_dict(rank0_only=False).items() if k not in engine.saved_as}
    names = stored_names(engine)
    optimizer, tied = {}, {}
    for fp in engine.flat_params:
        state = engine.optimizer.state[fp.master]
        for slot in fp.slots:
            at = slot.offset - fp.master_base
            values = {
                key: value.narrow(0, at, slot.numel).view(slot.shape).clone() if value.dim() else value.clone()
                for key, value in state.items()
            }
            copy = saved_elsewhere(engine, fp)
            (tied if copy else optimizer)[slot.name if copy else names[id(fp), slot.name]] = values
    return {"params": params, "optimizer": optimizer, "tied": tied}


def save_job(model_name, layout, path, record=False) -> dict:
    """Train to the save point, save, train on; the losses after the save (and the state at it, if ``record``)."""
    model, engine, runner, mesh = build(model_name, **layout)
    train(model_name, model, engine, runner, mesh, 0, SAVED_AT)
    save(path, model, engine)
    state = whole_state(engine) if record else None
    return {"losses": train(model_name, model, engine, runner, mesh, SAVED_AT, STEPS), "state": state}


def load_job(model_name, layout, path, resave=None) -> dict:
    """Load into a fresh model at ``layout``, save again at ``resave`` if given, train the steps after the save."""
    model, engine, runner, mesh = build(model_name, **layout)
    load(path, model, engine)
    if resave is not None:
        save(resave, model, engine)
    return {"losses": train(model_name, model, engine, runner, mesh, SAVED_AT, STEPS)}


def failed_load(model_name, layout, path) -> str:
    """The error a load at ``layout`` raises (or "no error")."""
    model, engine, _, _ = build(model_name, **layout)
    try:
        load(path, model, engine)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


JOBS = {"save": save_job, "load": load_job, "failed_load": failed_load}


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, str, dict]]) -> list:
    """``[(job, model, keyword arguments)]`` run one after another by every rank."""
    return [JOBS[job](model_name, **kwargs) for job, model_name, kwargs in jobs]
