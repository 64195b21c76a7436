"""The chaos matrix's runs: two gloo ranks train, and rank 1 is SIGKILLed or raises at one chosen moment of step
``FAULT_STEP``, while rank 0 goes on into what that moment waits on: an engine collective (a stage-3 gather, a
gradient reduction, the step's), a library's (DCP inside a sharded save or load, torch's pipeline send/recv, Fabric's
``all_reduce`` in an evaluation loop and its ``barrier``, DTensor redistributions in a tensor-parallel forward,
accelerate's ``save_state``, the HF Trainer's checkpoint save, the barrier that ends Fabric's single-file save while
rank 0 writes the file), a Ulysses all-to-all, or an NVMe swap-in before the
step's collectives. ``tests/e2e/test_rank_fault_matrix.py`` asserts on what each run left: rank 0's error, when it
came, and the checkpoints.

A rank's uncaught error goes where an uncaught error of a real job goes: through ``sys.excepthook`` (which records it
on the failure board and prints it), then the process exits non-zero. Both process groups' timeouts are
``TIMEOUT_S``: a run that ends well before it was told of the failure, not timed out.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import distributed
import models
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_runs import global_batches
from distributed import set_lightning_environment
from training_loops import full_state

from ds_strategy.checkpoint import latest, load, save
from ds_strategy.checkpoint.storage import ChecksummedReader, ChecksummedWriter
from ds_strategy.config import ZeroConfig
from ds_strategy.offload import step_runner_for
from ds_strategy.offload.nvme_swapper import SwapFile
from ds_strategy.zero.engine import ZeroEngine

WORLD_SIZE, VICTIM = 2, 1
STEPS, FAULT_STEP = 3, 2
TIMEOUT_S = 60.0  # the process group's timeout and the engine's collective_timeout
START_S = 120.0  # forking and joining two ranks, on a loaded machine
MOMENTS = (
    "forward",
    "backward",
    "step",
    "save",
    "load",
    "nvme_swap_in",
    "pipeline_send",
    "ulysses_all_to_all",
    "evaluation",
    "barrier",
    "tensor_parallel_forward",
    "accelerate_save",
    "hf_trainer_save",
    "full_save",
)
FAULTS = ("sigkill", "raise")


class Fault:
    """Rank 1's fault at ``moment`` of step FAULT_STEP: SIGKILL, or a ValueError, its time written first."""

    def __init__(self, moment: str, kind: str, rank: int, out: Path):
        self.moment, self.kind, self.armed, self.out = moment, kind, rank == VICTIM, out
        self.step = 0

    def at(self, moment: str) -> None:
        if self.armed and moment == self.moment and self.step == FAULT_STEP:
            self.armed = False
            (self.out / "faulted_at").write_text(repr(time.time()))
            if self.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"rank {VICTIM} failed at {moment} on purpose")

    def inside(self, owner, name: str, moment: str) -> None:
        """Fault when ``owner.name`` (a library's step this moment waits in) is called: a kill as it starts."""
        original = getattr(owner, name)

        def faulting(*args, **kwargs):
            self.at(moment)
            return original(*args, **kwargs)

        setattr(owner, name, faulting)


# -- the moments ------------------------------------------------------------------------------------------------
def _rows(engine_rank: int, batch):
    rows = batch[0].shape[0] // WORLD_SIZE
    return tuple(t[engine_rank * rows : (engine_rank + 1) * rows] for t in batch)


def _train(model, engine, fault: Fault, first: int = 1, root: Path | None = None) -> None:
    """Steps ``first..STEPS`` of TinyGPT, each saved to ``root/step_K`` when ``root`` is given."""
    for step, batch in enumerate(global_batches()[first - 1 : STEPS], start=first):
        fault.step = step
        fault.at("forward")
        loss = model(_rows(engine.rank, batch))
        fault.at("backward")
        engine.backward(loss)
        fault.at("step")
        engine.clip_grad_norm_(1.0)
        engine.step()
        if root is not None:
            save(root / f"step_{step}", model, engine, extra={"step": step})


def build(**fields):
    """TinyGPT and its engine (AdamW, as ``checkpoint_runs``), ``collective_timeout`` TIMEOUT_S; stage 2 unless told."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    zero = ZeroConfig(**{"stage": 2, "collective_timeout": TIMEOUT_S, **fields})
    return model, ZeroEngine(model, optimizer, zero, step_runner=step_runner_for(zero))


def _engine(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    zero3 = {"stage": 3, "param_persistence_threshold": 0}  # every unit gathered in forward
    model, engine = build(**(zero3 if fault.moment == "forward" else {}))
    _train(model, engine, fault)


def _nvme(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    model, engine = build(offload_optimizer="nvme", nvme_path=str(out / "nvme"))
    fault.inside(SwapFile, "read", "nvme_swap_in")
    _train(model, engine, fault)


def _save(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    model, engine = build()
    _arm_save(fault, "save")
    _train(model, engine, fault, root=out / "checkpoints")


def _load(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    model, engine = build()
    fault.step = FAULT_STEP
    fault.inside(*((ChecksummedReader, "read_data") if fault.kind == "sigkill" else (dcp, "load")), "load")
    load(reference / f"step_{FAULT_STEP - 1}", model, engine)


def _pipeline(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    from pipeline_runs import batches, build_pipeline, loss_fn

    model, engine, runner, mesh = build_pipeline("mlp", "adamw", stage=1, pipeline_parallel_size=2)
    for step, (x, y) in enumerate(batches("mlp", STEPS, 4), start=1):
        fault.step = step
        fault.at("pipeline_send")
        runner.train_step(x, y, loss_fn)
        engine.step()


def _ulysses(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    from ds_strategy.models import GPT, GPTConfig
    from ds_strategy.parallel.ulysses import sequence_parallel_loss, shard_sequence, ulysses_sdpa

    config = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(config, attention=ulysses_sdpa(dist.group.WORLD))
    for step in range(1, STEPS + 1):
        fault.step = step
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        local = shard_sequence({"input_ids": ids, "labels": ids.clone()}, dist.group.WORLD, ignore_index=-1)
        fault.at("ulysses_all_to_all")
        logits, _ = model(local["input_ids"], positions=local["position_ids"])
        sequence_parallel_loss(logits, local["shift_labels"], dist.group.WORLD, ignore_index=-1).backward()


def _fabric(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    """A Fabric loop at stage 3: a training step, then evaluation (its loss summed by ``fabric.all_reduce``) and
    ``fabric.barrier()``, every step."""
    import lightning as L
    from pipeline_runs import batches, loss_fn, mlp_stack

    from ds_strategy import ZeroFabricStrategy

    set_lightning_environment(rank)
    strategy = ZeroFabricStrategy(stage=3, timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = mlp_stack()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step, (x, y) in enumerate(batches("mlp", STEPS, 4), start=1):
        fault.step = step
        x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            loss = loss_fn(model(x), y)
        fault.at("evaluation")
        fabric.all_reduce(loss, reduce_op="sum")
        model.train()
        fault.at("barrier")
        fabric.barrier()


def _tensor_parallel(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    """A Fabric loop over a Llama split by the user's ``parallelize_fn`` (torch's ``parallelize_module``: its
    forward redistributes DTensors through torch's functional collectives, not ours)."""
    import hf_models
    import lightning as L
    from tensor_parallel_llama import LAYER_PLAN, LLAMA, token_data
    from torch.distributed.tensor.parallel import parallelize_module

    from ds_strategy import ZeroFabricStrategy

    def parallelize(model, device_mesh):
        for layer in model.model.layers:
            parallelize_module(layer, device_mesh["tensor_parallel"], LAYER_PLAN)
        return model

    set_lightning_environment(rank)
    strategy = ZeroFabricStrategy(
        stage=2, tensor_parallel_size=2, parallelize_fn=parallelize, timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S
    )
    fabric = L.Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    model = hf_models.build("llama", **LLAMA)
    model, optimizer = fabric.setup(model, hf_models.adamw(model))
    for step, ids in enumerate(token_data(dp=1)[:STEPS], start=1):
        fault.step = step
        fault.at("tensor_parallel_forward")
        fabric.backward(model(input_ids=ids[None], labels=ids[None]).loss)
        optimizer.step()
        optimizer.zero_grad()


def _accelerate_save(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    _arm_save(fault, "accelerate_save")
    accelerate_loop(rank, fault, out / "checkpoints")


def accelerate_loop(rank: int, fault: Fault, root: Path, resume: Path | None = None) -> dict:
    """An accelerate loop at stage 2 that calls ``accelerator.save_state(root/step_K)`` after every step (from
    ``resume``'s step on, after ``load_state(resume)``); the final weights."""
    from accelerate.state import AcceleratorState, GradientState
    from distributed import set_torchrun_environment
    from pipeline_runs import batches, loss_fn, mlp_stack

    from ds_strategy.accelerate import ZeroAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    set_torchrun_environment(rank, WORLD_SIZE)
    accelerator = ZeroAccelerator({"stage": 2, "timeout": TIMEOUT_S, "collective_timeout": TIMEOUT_S}, cpu=True)
    torch.manual_seed(0)
    model = mlp_stack()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    first = 1
    if resume is not None:
        accelerator.load_state(str(resume))
        first = int(resume.name.removeprefix("step_")) + 1
    for step, (x, y) in enumerate(batches("mlp", STEPS, 4)[first - 1 :], start=first):
        fault.step = step
        accelerator.backward(loss_fn(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state(str(root / f"step_{step}"))
    return accelerator.engine.full_state_dict(rank0_only=False)


def _full_save(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    fabric_full_save_loop(rank, fault, out / "checkpoints")


def fabric_full_save_loop(rank: int, fault: Fault, root: Path, resume: Path | None = None) -> dict:
    """A Fabric loop at stage 2 with ``state_dict_type="full"``, ``fabric.save(root/step_K.pt)`` after every step
    (from ``resume``'s step on, after ``fabric.load(resume)``); rank 1's fault as it enters the barrier that ends the
    save, while rank 0 writes the file. The final weights."""
    import lightning as L
    from pipeline_runs import batches, loss_fn, mlp_stack

    from ds_strategy import ZeroFabricStrategy

    set_lightning_environment(rank)
    strategy = ZeroFabricStrategy(stage=2, state_dict_type="full", timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = mlp_stack()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    first = 1
    if resume is not None:
        fabric.load(resume, {"model": model, "optimizer": optimizer})
        first = int(resume.stem.removeprefix("step_")) + 1
    fault.inside(strategy, "barrier", "full_save")
    for step, (x, y) in enumerate(batches("mlp", STEPS, 4)[first - 1 :], start=first):
        fault.step = step
        fabric.backward(loss_fn(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
        optimizer.step()
        optimizer.zero_grad()
        fabric.save(root / f"step_{step}.pt", {"model": model, "optimizer": optimizer, "step": step})
    return strategy.get_module_state_dict(model)


def _hf_trainer_save(rank: int, fault: Fault, out: Path, reference: Path) -> None:
    hf_trainer_run(rank, fault, out / "checkpoints")


def hf_trainer_run(rank: int, fault: Fault, root: Path, resume: Path | None = None) -> dict:
    """``ZeroTrainer.train()`` of a tiny Llama at stage 2, saving a checkpoint every step into ``root`` (resumed
    from ``resume``); the final weights."""
    import hf_models
    from accelerate.state import AcceleratorState, GradientState
    from distributed import set_torchrun_environment
    from hf_trainer_runs import TokenRows, arguments

    from ds_strategy.transformers import ZeroTrainer

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    set_torchrun_environment(rank, WORLD_SIZE)
    args = arguments(root, max_steps=STEPS, save_steps=1, eval_strategy="no", gradient_accumulation_steps=1)
    trainer = ZeroTrainer(
        model=hf_models.build("llama"),
        args=args,
        train_dataset=TokenRows(2 * WORLD_SIZE * STEPS, 1),
        zero_config={"stage": 2, "timeout": TIMEOUT_S, "collective_timeout": TIMEOUT_S},
    )
    _arm_save(fault, "hf_trainer_save", step_of=lambda: trainer.state.global_step)
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return trainer.zero_engine.full_state_dict(rank0_only=False)


def _arm_save(fault: Fault, moment: str, step_of=None) -> None:
    """The save's fault: a kill while this rank writes its shard, a raise as DCP's save starts; ``step_of`` reads
    the step from the loop that saves, before the fault looks at it (else the loop sets ``fault.step``)."""
    owner, name = (ChecksummedWriter, "write_data") if fault.kind == "sigkill" else (dcp, "save")
    fault.inside(owner, name, moment)
    if step_of is not None:
        faulting = getattr(owner, name)

        def stepped(*args, **kwargs):
            fault.step = step_of()
            return faulting(*args, **kwargs)

        setattr(owner, name, stepped)


SCENARIOS = {
    "forward": _engine,
    "backward": _engine,
    "step": _engine,
    "save": _save,
    "load": _load,
    "nvme_swap_in": _nvme,
    "pipeline_send": _pipeline,
    "ulysses_all_to_all": _ulysses,
    "evaluation": _fabric,
    "barrier": _fabric,
    "tensor_parallel_forward": _tensor_parallel,
    "accelerate_save": _accelerate_save,
    "hf_trainer_save": _hf_trainer_save,
    "full_save": _full_save,
}


# -- one rank of a cell --------------------------------------------------------------------------------------------
def _cell_rank(rank: int, out: Path, moment: str, kind: str, reference: Path) -> None:
    """Run ``moment``'s scenario; an uncaught error goes through ``sys.excepthook`` (recorded on the failure board
    and printed, as in any job), rank 0's also to ``error0.json``, and the process exits 1."""
    torch.set_num_threads(1)
    log = os.open(out / f"stderr{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        SCENARIOS[moment](rank, Fault(moment, kind, rank, out), out, reference)
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - every error is the cell's outcome
        if rank != VICTIM:
            said = {"type": type(error).__name__, "message": str(error), "at": time.time()}
            said["cause"] = type(error.__cause__).__name__ if error.__cause__ is not None else None
            (out / "error0.json").write_text(json.dumps(said))
        sys.excepthook(type(error), error, error.__traceback__)
        sys.stderr.flush()
        os._exit(1)


def run_cell(moment: str, kind: str, out: Path, reference: Path) -> dict:
    """Both ranks of one cell, until both exit (or ``TIMEOUT_S`` plus start-up passed); what rank 0 said and when."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = distributed._start_context()
    procs = [
        ctx.Process(target=_cell_rank, args=(r, out, moment, kind, reference), daemon=True) for r in range(WORLD_SIZE)
    ]
    started = time.time()
    for proc in procs:
        proc.start()
    try:
        while any(proc.exitcode is None for proc in procs) and time.time() - started < START_S + 2 * TIMEOUT_S:
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    ended = time.time()
    faulted = out / "faulted_at"
    error = out / "error0.json"
    return {
        "exit_codes": [proc.exitcode for proc in procs],
        "faulted_at": float(faulted.read_text()) if faulted.exists() else None,
        "ended_at": ended,
        "error": json.loads(error.read_text()) if error.exists() else None,
        "stderr0": (out / "stderr0").read_text() if (out / "stderr0").exists() else "",
    }


# -- the uninterrupted run and the resumed one (run_ranks) ----------------------------------------------------------
class _NoFault(Fault):
    def __init__(self):
        super().__init__("", "", -1, Path())


def adapter_rank(rank: int, world_size: int, adapter: str, root: Path, resume: Path | None = None) -> dict | None:
    """Accelerate's loop, the HF Trainer or Fabric's single-file saves (``adapter``: "accelerate_save",
    "hf_trainer_save", "full_save") uninterrupted, or resumed from ``resume``; rank 0 returns the final weights."""
    run = {"accelerate_save": accelerate_loop, "hf_trainer_save": hf_trainer_run, "full_save": fabric_full_save_loop}[
        adapter
    ]
    final = run(rank, _NoFault(), root, resume)
    return final if rank == 0 else None


def reference_rank(rank: int, world_size: int, root: Path) -> dict | None:
    """The uninterrupted run, saving ``root/step_K`` after every step; rank 0 returns its final parameters."""
    model, engine = build()
    _train(model, engine, _NoFault(), root=root)
    state = full_state(engine, model)
    return state if rank == 0 else None


def resume_rank(rank: int, world_size: int, root: Path) -> dict | None:
    """A restart from ``latest(root)``, trained to the end; rank 0 returns the step it resumed from and the final
    parameters."""
    model, engine = build()
    start = load(latest(root), model, engine)["step"]
    _train(model, engine, _NoFault(), first=start + 1)
    state = full_state(engine, model)
    return {"start": start, "final": state} if rank == 0 else None
