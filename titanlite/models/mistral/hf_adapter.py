"""Mistral <-> Hugging Face MistralForCausalLM: Llama's names and RoPE permutation, Mistral's config."""

from titanlite.models.llama.hf_adapter import LlamaHFAdapter


class MistralHFAdapter(LlamaHFAdapter):
    architectures = ["MistralForCausalLM"]
    model_type = "mistral"

    def hf_config(self, args, dtype: str = "float32") -> dict:
        config = super().hf_config(args, dtype)
        for key in ("attention_bias", "mlp_bias"):  # MistralConfig has neither: no biases, ever
            config.pop(key)
        # Same convention as ours: a token attends to the sliding_window most recent tokens, itself included.
        config["sliding_window"] = args.sliding_window
        return config
