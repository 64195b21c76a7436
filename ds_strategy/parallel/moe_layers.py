"""Where a model's mixture-of-experts layers keep their experts: the containers expert parallelism shards.

Note: [The experts container interface]
  transformers 5.x builds every MoE model's experts as one module holding 3-D parameters, one row per expert
  (Qwen3-MoE's ``Qwen3MoeExperts``, DeepSeek-V3's ``DeepseekV3Experts``, Mixtral's, gpt-oss's), called by the MoE
  block as ``experts(hidden_states, top_k_index, top_k_weights)`` after its router chose. That call is the
  interface, and a user's own MoE module meets it with a container that has:
    - ``num_experts``: an int attribute, the number of experts;
    - its own parameters stacked one row per expert, ``[num_experts, ...]``, at least one of them 3-D (a router's
      ``[num_experts, hidden]`` weight is not a container); parameters of other shapes, or in submodules, are not
      experts' and stay whole on every rank;
    - ``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``: the weighted sum
      of each token's K experts, for any ``num_experts`` rows it holds (indices count from its first row).
  The router, shared experts and auxiliary losses live outside the container and are left alone. Models that keep
  one module per expert (an ``nn.ModuleList`` of MLPs) are refused by name: fuse them into such a container.
"""

from __future__ import annotations

from torch import nn


def is_experts_container(module: nn.Module) -> bool:
    """Whether ``module`` meets Note: [The experts container interface]: an int ``num_experts`` and at least one
    3-D parameter of its own stacked one row per expert."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return False
    own = list(module.parameters(recurse=False))
    return any(p.dim() == 3 and p.shape[0] == count for p in own)


def find_experts_containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every experts container in ``model`` (outermost first, none nested in another), by name; ValueError naming
    the model when there is none, or when its experts are one module each."""
    found = [(name, m) for name, m in model.named_modules() if is_experts_container(m)]
    if found:
        return found
    per_expert = [
        name for name, m in model.named_modules() if name.endswith("experts") and isinstance(m, nn.ModuleList)
    ]
    if per_expert:
        raise ValueError(
            f"expert_parallel_size > 1 but {type(model).__name__} keeps one module per expert ({per_expert[0]!r}); "
            f"expert parallelism needs the experts fused into one container (Note: [The experts container "
            f"interface] in ds_strategy.parallel.moe_layers)"
        )
    raise ValueError(
        f"expert_parallel_size > 1 but {type(model).__name__} has no experts container (a module with an int "
        f"num_experts and parameters stacked one row per expert, called as experts(hidden_states, top_k_index, "
        f"top_k_weights)); see Note: [The experts container interface] in ds_strategy.parallel.moe_layers"
    )
