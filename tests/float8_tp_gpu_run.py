"""Run under torchrun (one process) by test_float8_tp.py's cuda-tier test: Llama's TP plan on a 1-rank
TP mesh, with float8 linears, against the same float8 model without TP: one forward and backward on
the same tokens. On CUDA the plan carries torchao's float8 styles (checked) and the matmuls are the
real float8 kernels; argv[1] cuda or cpu (gloo, emulated float8, the plain styles), argv[2] the recipe.
Exits non-zero (an AssertionError) where they differ."""

import copy
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titanlite.config_sections import Float8
from titanlite.models.llama.args import LLAMA3_FLAVORS
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.parallelize import attention_plan, swiglu_plan
from titanlite.parallel.float8 import convert_linears
from titanlite.parallel.tp import apply_tp_plan, vocab_parallel_plan, with_float8_styles


def main(device: str, recipe: str) -> None:
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (1,))
    args = replace(LLAMA3_FLAVORS["debugmodel"], n_layers=2, vocab_size=512)
    torch.manual_seed(0)
    with torch.device(device):
        reference = Transformer(args)
    reference.init_weights()
    reference.to(torch.bfloat16)
    convert_linears(reference, Float8(enable=True, recipe_name=recipe), emulate=device == "cpu")
    model = copy.deepcopy(reference)
    block_plan = {**attention_plan(), **swiglu_plan()}
    styles = {
        fqn: type(style).__name__
        for fqn, style in with_float8_styles(model.layers["0"], block_plan, device == "cuda").items()
    }
    if device == "cuda" and recipe == "tensorwise":
        assert (
            styles["attention.wq"] == "Float8ColwiseParallel" and styles["feed_forward.w2"] == "Float8RowwiseParallel"
        ), styles
        assert styles["attention"] == styles["feed_forward"] == "PrepareFloat8ModuleInput", styles
    else:
        assert styles["attention.wq"] == "ColwiseParallel" and styles["attention"] == "PrepareModuleInput", styles
    apply_tp_plan(model, mesh, vocab_parallel_plan(False), block_plan)

    tokens = torch.randint(0, args.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for m in (reference, model):
        logits = m(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-3, losses
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        torch.testing.assert_close(grad.float(), p.grad.float(), rtol=2e-2, atol=1e-4, msg=name)
    print(f"float8 {recipe} under TP on {device}: loss {losses[1]:.6f}, 1 process {losses[0]:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
