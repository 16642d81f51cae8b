"""Mistral <-> Hugging Face MistralForCausalLM: Llama's names and RoPE permutation, Mistral's config."""

from titanlite.models.llama.hf_adapter import LlamaHFAdapter
from titanlite.models.mistral.args import MistralArgs


class MistralHFAdapter(LlamaHFAdapter):
    architectures = ["MistralForCausalLM"]
    model_type = "mistral"
    args_class = MistralArgs

    def hf_config(self, args, dtype: str = "float32") -> dict:
        config = super().hf_config(args, dtype)
        for key in ("attention_bias", "mlp_bias"):  # MistralConfig has neither: no biases, ever
            config.pop(key)
        # Same convention as ours: a token attends to the sliding_window most recent tokens, itself included.
        config["sliding_window"] = args.sliding_window
        return config

    def args_fields(self, config: dict) -> dict:
        # Absent, transformers' MistralConfig takes a window of 4096.
        return {**super().args_fields(config), "sliding_window": config.get("sliding_window", 4096)}
