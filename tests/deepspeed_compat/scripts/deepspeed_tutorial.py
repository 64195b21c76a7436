"""A training script as DeepSpeed's tutorials write it: ``deepspeed.initialize`` with the optimizer and a warmup
scheduler from the JSON config (or the script's own AdamW), gradient accumulation, DeepSpeed's data loader,
``save_checkpoint`` every N optimizer steps with client state, and ``load_checkpoint`` to resume.

It is run twice by ``tests/deepspeed_compat/test_deepspeed_initialize_oracle.py``'s recorder: once as is, under real
DeepSpeed, and once with the import line changed to ``import ds_strategy.deepspeed as deepspeed`` (the test writes that
copy). Nothing else differs. Rank 0 writes what the run saw, step by step, to ``--out`` (JSON).

    torchrun --nproc_per_node 2 deepspeed_tutorial.py --deepspeed_config ds.json --steps 6 --out run.json
"""

import argparse
import json

import deepspeed
import torch
import torch.nn.functional as F

FEATURES, HIDDEN, SAMPLES = 12, 20, 256


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(FEATURES, HIDDEN)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU())
            for _ in range(2)
        )
        self.out = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)


def dataset():
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, :3].sum(-1) - x[:, 3:6].prod(-1)).tanh() + 0.05 * torch.randn(SAMPLES, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def parse_args():
    parser = argparse.ArgumentParser(description="DeepSpeed tutorial-style training")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the DeepSpeed launcher")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps to train in this run")
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--save_every", type=int, default=0, help="checkpoint every N optimizer steps")
    parser.add_argument("--resume", default=None, help="a save_checkpoint directory to resume from")
    parser.add_argument("--own_optimizer", action="store_true", help="AdamW built here instead of the config's")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Net()
    optimizer = None
    if args.own_optimizer:
        decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
        other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
        parameters = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(parameters, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    else:
        parameters = model.parameters()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=parameters, optimizer=optimizer, training_data=dataset()
    )
    client_state = {"micro_steps": 0}
    if args.resume:
        _, client_state = engine.load_checkpoint(args.resume)
    record = {"losses": [], "lrs": [], "applied": [], "grad_norms": [], "resumed_at": engine.global_steps}
    skip = client_state["micro_steps"]
    last_step = engine.global_steps + args.steps
    seen = 0
    while engine.global_steps < last_step:
        for x, y in loader:
            seen += 1
            if seen <= skip:  # the batches the checkpointed run already trained on
                continue
            x, y = x.to(engine.device), y.to(engine.device)
            if engine.fp16_enabled():
                x = x.half()
            elif engine.bfloat16_enabled():
                x = x.bfloat16()
            loss = F.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            mean = loss.detach().clone()
            deepspeed.comm.all_reduce(mean)
            record["losses"].append(mean.item() / deepspeed.comm.get_world_size())
            if boundary:
                record["lrs"].append(engine.get_lr()[0])
                record["applied"].append(engine.was_step_applied())
                norm = engine.get_global_grad_norm()
                record["grad_norms"].append(None if norm is None else float(norm))
                if args.save_every and engine.global_steps % args.save_every == 0:
                    engine.save_checkpoint(args.save_dir, client_state={"micro_steps": seen})
            if engine.global_steps >= last_step:
                break
    record.update(global_steps=engine.global_steps, global_samples=engine.global_samples)
    if deepspeed.comm.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
