"""Llama <-> Hugging Face LlamaForCausalLM: names, the RoPE row permutation, config.json.

Families built from llama's blocks (Mistral, Mixtral) can subclass LlamaHFAdapter and extend
`names`, `architectures` and `model_type`.
"""

import torch

from titanlite.errors import UserError
from titanlite.models.hf import (
    HFAdapter,
    build_args,
    required,
    rope_halves_to_pairs,
    rope_pairs_to_halves,
    rope_parameters,
)
from titanlite.models.llama.args import ModelArgs, RopeScaling


class LlamaHFAdapter(HFAdapter):
    architectures = ["LlamaForCausalLM"]
    model_type = "llama"
    args_class = ModelArgs
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
        "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
        "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
        "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
        "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
        "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
        "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
        "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
        "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    ignored = (r"\.rotary_emb\.inv_freq$",)  # older exports store the RoPE frequencies
    shape_keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )

    def _rope_heads(self, name: str, args) -> int | None:
        if name.endswith("attention.wq.weight"):
            return args.n_heads
        if name.endswith("attention.wk.weight"):
            return args.n_kv_heads
        return None

    def tensor_to_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        heads = self._rope_heads(name, args)
        return tensor if heads is None else rope_pairs_to_halves(tensor, heads)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        heads = self._rope_heads(name, args)
        return tensor if heads is None else rope_halves_to_pairs(tensor, heads)

    def hf_config(self, args, dtype: str = "float32") -> dict:
        config = {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "num_hidden_layers": args.n_layers,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len,
            "rope_theta": args.rope_theta,
            "rms_norm_eps": args.norm_eps,
            "tie_word_embeddings": args.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": dtype,
        }
        if args.rope_scaling is not None:
            scaling = args.rope_scaling
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_seq_len,
            }
        return config

    def args_fields(self, config: dict) -> dict:
        """The args' fields from config.json; families built on Llama's blocks add theirs."""
        heads = required(config, "num_attention_heads")
        rope = rope_parameters(config)
        return dict(
            dim=required(config, "hidden_size"),
            n_layers=required(config, "num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads,
            vocab_size=required(config, "vocab_size"),
            intermediate_size=required(config, "intermediate_size"),
            norm_eps=config.get("rms_norm_eps", 1e-6),  # absent keys take transformers' defaults
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=llama3_rope_scaling(rope),
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def args_from_hf_config(self, config: dict):
        return build_args(self.args_class, self.args_fields(config))


def llama3_rope_scaling(rope: dict) -> RopeScaling | None:
    """None for plain RoPE, Llama 3.1's long-context scaling for rope_type llama3; other types are refused."""
    if rope["rope_type"] == "default":
        return None
    if rope["rope_type"] != "llama3":
        raise UserError(
            f"its config.json has rope_type {rope['rope_type']}, which titanlite's Llama blocks do not "
            "compute (they know default and llama3)"
        )
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=int(rope["original_max_position_embeddings"]),
    )
