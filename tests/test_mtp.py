"""DeepSeek-V3 multi-token prediction (models/deepseek_v3/mtp.py): the rolled window equals the truncated one, an
HF folder with an MTP layer round-trips exactly, its refusals, and FSDP2 on 2 ranks equals 1 process."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_planned_state, run_titanlite, tensorboard_scalars
from safetensors.torch import load_file, save_file

from titanlite.checkpoint.hf_io import load_model_from_hf, save_model_as_hf
from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.models import get_model_spec
from titanlite.models.attention import attention_mask

SPEC = get_model_spec("deepseek_v3")
ADAPTER = SPEC.hf_adapter


def small_args(**overrides):
    args = dataclasses.replace(
        SPEC.flavors["debugmodel"],
        vocab_size=97,
        n_layers=2,
        n_dense_layers=1,
        dim=32,
        n_heads=2,
        ffn_hidden_dim=48,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        moe_hidden_dim=16,
        num_experts=4,
        top_k=2,
        n_group=2,
        topk_group=1,
        max_seq_len=32,
        mtp_layers=1,
    )
    return dataclasses.replace(args, **overrides)


def model_of(args, seed=0):
    model = SPEC.model_cls(args)
    model.init_weights(seed=seed)
    return model


def test_the_rolled_window_is_the_truncated_one():
    """Depth 1 on the whole window with rolled tokens gives the loss of the paper's form: depth 1 on the first
    T - 1 positions with the next tokens' embeddings, predicting the tokens two places ahead."""
    model = model_of(small_args()).train()
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    _, extra = model(tokens, extra_losses=True)
    layer = model.mtp["0"]
    with torch.no_grad():
        h, _ = model.run_main_blocks(
            model.tok_embeddings(tokens), model.rope_cos, model.rope_sin, attention_mask(None, None, "cpu")
        )
        short = layer(h[:, :-1], model.tok_embeddings(tokens[:, 1:]), model.rope_cos, model.rope_sin, None)
        logits = model.output(layer.norm(short[:, :-1]))
        expected = F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten())
    torch.testing.assert_close(extra["mtp"].detach(), 0.3 * expected, rtol=1e-6, atol=1e-6)
    assert model.extra_metrics()["loss/mtp"] == pytest.approx(expected.item(), rel=1e-6)


def transformers_folder_with_an_mtp_layer(folder, args):
    """transformers' DeepseekV3 knows no MTP: it writes a random model one block deeper, whose last block becomes
    the MTP layer's block; the test adds the MTP layer's own tensors and copies of the shared matrices, and
    says num_hidden_layers n_layers, num_nextn_predict_layers 1."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = ADAPTER.hf_config(dataclasses.replace(args, n_layers=args.n_layers + 1, mtp_layers=0))
    DeepseekV3ForCausalLM(DeepseekV3Config(**config)).save_pretrained(folder)
    tensors = {
        name: t.normal_() if t.dim() > 1 else t.uniform_()
        for name, t in load_file(folder / "model.safetensors").items()
    }
    mtp = f"model.layers.{args.n_layers}."
    tensors.update(
        {
            mtp + "enorm.weight": torch.rand(args.dim),
            mtp + "hnorm.weight": torch.rand(args.dim),
            mtp + "eh_proj.weight": torch.randn(args.dim, 2 * args.dim),
            mtp + "shared_head.norm.weight": torch.rand(args.dim),
            mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
            mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        }
    )
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": args.n_layers, "num_nextn_predict_layers": 1})
    )
    return tensors


def test_an_hf_folder_with_an_mtp_layer_round_trips_exactly(tmp_path):
    args = small_args()
    tensors = transformers_folder_with_an_mtp_layer(tmp_path / "in", args)
    model = model_of(args)
    load_model_from_hf(model.state_dict(), tmp_path / "in", ADAPTER, args, "deepseek_v3/test")
    torch.testing.assert_close(model.mtp["0"].eh_proj.weight, tensors["model.layers.2.eh_proj.weight"], rtol=0, atol=0)
    save_model_as_hf(model.state_dict(), tmp_path / "out", ADAPTER, args, torch.float32, writer_rank=True)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(written) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_an_mtp_copy_that_differs_and_a_folder_without_mtp_are_one_sentence(tmp_path):
    args = small_args()
    tensors = transformers_folder_with_an_mtp_layer(tmp_path, args)
    tensors["model.layers.2.embed_tokens.weight"] += 1
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="model.layers.2.embed_tokens.weight differs from the model's own matrix"):
        load_model_from_hf(model_of(args).state_dict(), tmp_path, ADAPTER, args, "deepseek_v3/test")
    deeper = dataclasses.replace(args, mtp_layers=2)
    with pytest.raises(UserError, match="num_nextn_predict_layers 1, fewer than model.mtp_layers 2"):
        load_model_from_hf(model_of(deeper).state_dict(), tmp_path, ADAPTER, deeper, "deepseek_v3/test")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.mtp_layers", "1"], "model llama3 has no multi-token prediction"),
        (
            ["--model.name", "deepseek_v3", "--model.mtp_layers", "1", "--parallelism.tensor_parallel_degree", "2"],
            "parallelism.tensor_parallel_degree 2 is not supported yet",
        ),
        (["--model.mtp_loss_weight", "0.1"], "set model.mtp_layers above 0"),
    ],
)
def test_refusals(flags, message):
    with pytest.raises(UserError, match=message):
        load_config(flags)


def mtp_run(folder, local_batch):
    return [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(folder),
        "--model.name",
        "deepseek_v3",
        "--model.mtp_layers",
        "1",
        "--training.dataset",
        "synthetic",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        str(local_batch),
        "--training.global_batch_size",
        "4",
        "--training.steps",
        "3",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--training.mixed_precision_param",
        "float32",
    ]


@pytest.mark.extended
def test_fsdp_two_ranks_equal_one_process(tmp_path):
    one, two = mtp_run(tmp_path / "one", 4), mtp_run(tmp_path / "two", 2)
    first = run_titanlite(one)
    assert first.returncode == 0, first.stderr
    second = run_titanlite(two, nproc=2)
    assert second.returncode == 0, second.stderr
    for tag in ("loss/train", "loss/mtp"):
        single, sharded = (tensorboard_scalars(tmp_path / name / "tb", tag) for name in ("one", "two"))
        assert sorted(single) == sorted(sharded) == [1, 2, 3], tag
        for step in single:
            assert sharded[step] == pytest.approx(single[step], rel=1e-5, abs=1e-5), (tag, step)
    assert_planned_state(one, 1, first.stderr)  # the planner counts the MTP layer's parameters and state
    assert_planned_state(two, 2, second.stderr)


def test_mtp_layers_a_run_leaves_out_are_said_once(tmp_path, caplog):
    """Issue 53: a folder holding an MTP layer, read with model.mtp_layers 0, loses the layer from the run and its
    export: the load says so in one line, naming the key that keeps it."""
    args = small_args()
    tensors = transformers_folder_with_an_mtp_layer(tmp_path / "in", args)
    without = dataclasses.replace(args, mtp_layers=0)
    model = model_of(without)
    with caplog.at_level("WARNING", logger="titanlite"):
        load_model_from_hf(model.state_dict(), tmp_path / "in", ADAPTER, without, "deepseek_v3/test")
    said = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert said == [
        f"the Hugging Face folder {tmp_path / 'in'} holds 1 multi-token prediction layer(s) beyond model.mtp_layers 0 "
        "(config.json num_nextn_predict_layers 1): they are not trained, and this run's exports leave them out; "
        "set model.mtp_layers 1 to keep them"
    ]
    save_model_as_hf(model.state_dict(), tmp_path / "out", ADAPTER, without, torch.float32, writer_rank=True)
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(
        n for n in tensors if not n.startswith("model.layers.2.")
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="titanlite"):  # read with its MTP layer: nothing left out, nothing said
        load_model_from_hf(model_of(args).state_dict(), tmp_path / "in", ADAPTER, args, "deepseek_v3/test")
    assert not [r for r in caplog.records if "multi-token prediction" in r.getMessage()]
