"""GPT-2 <-> Hugging Face GPT2LMHeadModel.

GPT-2's projections are Conv1D modules whose weight is [in, out], the transpose of nn.Linear's;
q, k and v stay fused in c_attn with the same [q | k | v] column order as titanlite's wqkv. The
output projection is tied to wte, so it is written once, as wte (as transformers saves it).
"""

import re

import torch

from titanlite.errors import UserError
from titanlite.models.gpt2.args import GPT2Args
from titanlite.models.hf import HFAdapter, build_args, required

_CONV1D = re.compile(r"^layers\.\d+\.(attention\.(wqkv|wo)|feed_forward\.w[12])\.weight$")


class GPT2HFAdapter(HFAdapter):
    architectures = ["GPT2LMHeadModel"]
    model_type = "gpt2"
    names = {
        "tok_embeddings.weight": "transformer.wte.weight",
        "pos_embeddings.weight": "transformer.wpe.weight",
        **{
            f"layers.{{}}.{ours}.{kind}": f"transformer.h.{{}}.{theirs}.{kind}"
            for ours, theirs in (
                ("attention_norm", "ln_1"),
                ("attention.wqkv", "attn.c_attn"),
                ("attention.wo", "attn.c_proj"),
                ("ffn_norm", "ln_2"),
                ("feed_forward.w1", "mlp.c_fc"),
                ("feed_forward.w2", "mlp.c_proj"),
            )
            for kind in ("weight", "bias")
        },
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
    }
    # The causal-mask buffers older transformers saved, and lm_head, which is wte again.
    ignored = (r"\.attn\.(masked_)?bias$", r"^lm_head\.weight$")
    shape_keys = ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")
    free_keys = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "initializer_range")  # titanlite trains without dropout

    def tensor_to_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor.t().contiguous() if _CONV1D.match(name) else tensor

    def tensor_from_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor.t().contiguous() if _CONV1D.match(name) else tensor

    def hf_config(self, args, dtype: str = "float32") -> dict:
        return {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "vocab_size": args.vocab_size,
            "n_positions": args.max_seq_len,
            "n_embd": args.dim,
            "n_layer": args.n_layers,
            "n_head": args.n_heads,
            "n_inner": None,  # 4 * n_embd
            "activation_function": "gelu_new",  # the tanh approximation
            "layer_norm_epsilon": args.norm_eps,
            # titanlite trains without dropout
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "scale_attn_weights": True,
            "tie_word_embeddings": True,
            "torch_dtype": dtype,
        }

    def args_from_hf_config(self, config: dict):
        dim = required(config, "n_embd")
        if config.get("n_inner") not in (None, 4 * dim):
            raise UserError(
                f"its config.json has n_inner {config['n_inner']}, where titanlite's GPT-2 has 4 x n_embd = {4 * dim}"
            )
        return build_args(
            GPT2Args,
            dict(
                dim=dim,
                n_layers=required(config, "n_layer"),
                n_heads=required(config, "n_head"),
                vocab_size=required(config, "vocab_size"),
                max_seq_len=config.get("n_positions", 1024),
                norm_eps=config.get("layer_norm_epsilon", 1e-5),
            ),
        )
