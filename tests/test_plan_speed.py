"""The speed model's reading of a model (titanlite/plan/speed.py), checked against a real forward and backward."""

from dataclasses import replace

import pytest
import torch
from conftest import build_meta, materialize
from torch import nn

from titanlite.models import get_model_args, get_model_spec
from titanlite.plan.job import job_speed
from titanlite.plan.published_rows import speed_inputs
from titanlite.plan.published_table import ROWS
from titanlite.plan.speed import cast_widths


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_float8_cast_widths_are_what_a_real_blocks_linears_take_and_give_back(family):
    """cast_widths reads a block's linears: what float8 casts per token is each distinct input a linear reads and
    each linear's output gradient; the whole-on-every-rank part under sequence parallelism is each sub-block's
    input and the gradient of its output. Both sums, taken by hooks on a real CPU step of one block, equal it."""
    args = replace(get_model_args(get_model_spec(family), "debugmodel"), vocab_size=97, n_layers=1, max_seq_len=16)
    model = materialize(family, args)
    block = model.layers["0"]
    inputs, grads, whole, made = {}, [], [], set()

    def read(linear, args_):
        inputs[args_[0].untyped_storage().data_ptr()] = linear.in_features

    def wrote(linear, args_, out):
        made.add(out.untyped_storage().data_ptr())

    def gave_back(linear, grad_input, grad_output):
        grads.append(linear.out_features)

    for part in (block.attention, block.feed_forward):
        part.register_forward_pre_hook(lambda _, args_: whole.append(args_[0].untyped_storage().data_ptr()))
        part.register_forward_hook(lambda _, args_, out: whole.append(out.untyped_storage().data_ptr()))
        for linear in part.modules():
            if isinstance(linear, nn.Linear):
                linear.register_forward_pre_hook(read)
                linear.register_forward_hook(wrote)
                linear.register_full_backward_hook(gave_back)
    model(torch.randint(0, 97, (2, 16))).float().sum().backward()
    sub_block_inputs, sub_block_outputs = whole[0::2], whole[1::2]
    assert set(sub_block_outputs) <= made  # each sub-block returns its output projection's result
    whole_width = sum(inputs[ptr] for ptr in sub_block_inputs) + args.dim * len(sub_block_outputs)
    assert cast_widths(block, args.dim) == (sum(inputs.values()) + sum(grads), whole_width)


def test_float8_cast_widths_of_llama3_8b():
    """Per token of one 8B block: inputs 4096 (wq, wk, wv's one), 4096 (wo), 4096 (w1, w3's one), 14,336 (w2);
    output gradients 4096 + 1024 + 1024 + 4096 + 3 x 14,336 - 14,336 + 4096 (w2 gives back 4096)."""
    block = build_meta("llama3", "8B").layers["0"]
    inputs = 4096 + 4096 + 4096 + 14_336
    grads = 4096 + 1024 + 1024 + 4096 + 14_336 + 4096 + 14_336
    assert cast_widths(block, 4096) == (inputs + grads, 4 * 4096)


def test_fsdp_collectives_hide_only_behind_the_compute_of_their_own_pass():
    """trainy's 8B on 32 H200 (measured 10,938 tps): FSDP's traffic is a little longer than the compute, and 5 of the
    6 bytes a weight moves (the backward's float8 all-gather and fp32 reduce-scatter) fall in the backward, two thirds
    of the compute, so the backward's excess shows though the forward has time to spare: the step is longer than
    both the compute and the collectives, and the planned tps within 15% of the measured."""
    item = next(row for row in ROWS if row.name == "8B, 32 H200, FSDP, compile, float8")
    speed = job_speed(*speed_inputs(item))
    assert speed.compute_s < speed.fsdp_s < 1.2 * speed.compute_s
    assert speed.step_s > 1.05 * speed.fsdp_s
    assert abs(speed.tps / item.tps - 1) < 0.15
