"""Small mixture-of-experts causal LMs as transformers 5.x builds them (fused 3-D experts), from configs: Qwen3-MoE
(every layer sparse, no shared experts) and DeepSeek-V3 (a dense first layer, a shared expert, grouped routing).
Hidden 32, 2 layers, 8 experts, top-2: small enough for 4 gloo ranks on a loaded 2-core machine."""

import torch
import transformers
from hf_models import SEQ, VOCAB

transformers.logging.set_verbosity_error()

EXPERTS = 8
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_experts_per_tok": 2,
    "max_position_embeddings": SEQ,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def config(name: str, **overrides):
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**_COMMON, "num_experts": EXPERTS, "norm_topk_prob": True, **overrides})
    if name == "deepseek_v3":
        shape = {
            **_COMMON,
            "num_key_value_heads": 2,
            "n_routed_experts": EXPERTS,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
        }
        return transformers.DeepseekV3Config(**{**shape, **overrides})
    raise ValueError(f"unknown MoE model {name!r}")


MODEL_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def build(name: str, seed: int = 0, spread_routers: bool = True, **overrides) -> transformers.PreTrainedModel:
    """``Model(config)`` under ``torch.manual_seed(seed)``, with ``spread_routers`` its router weights drawn again
    wider (DeepSeek-V3 starts them at zero, which would route every token alike), so that tokens spread over the
    experts as in a trained model. Without it the model is transformers' build alone, which a build on the meta device
    reproduces (Qwen3-MoE's routers are drawn at the initializer range)."""
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[name])(config(name, **overrides))
    model.config.use_cache = False  # training keeps no KV cache; a checkpointed layer's recomputation would extend it
    if not spread_routers:
        return model
    with torch.no_grad():
        for module_name, p in model.named_parameters():
            if module_name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model
