"""model.n_layers: a flavor's shapes with fewer blocks (to benchmark a big model on one GPU)."""

from conftest import DEBUG_CONFIG, ON_CPU

from titanlite.build import model_label, resolve_model_args
from titanlite.config import load_config
from titanlite.models import get_model_spec
from titanlite.train import main


def test_n_layers_overrides_the_flavors_depth_only():
    spec = get_model_spec("llama3")
    flavor = resolve_model_args(load_config(["--model.flavor", "8B"]), spec, 1000)
    two = resolve_model_args(load_config(["--model.flavor", "8B", "--model.n_layers", "2"]), spec, 1000)
    assert (flavor.n_layers, two.n_layers) == (32, 2)
    assert {**vars(two), "n_layers": 32} == vars(flavor)  # every other shape is the 8B's
    assert (
        model_label(load_config(["--model.flavor", "8B", "--model.n_layers", "2"]).model)
        == "llama3/8B with model.n_layers 2"
    )


def test_a_checkpoint_of_another_depth_is_refused(tmp_path, capsys):
    flags = [*ON_CPU, "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
    # In this process (main() is what the command exits with), sparing the suite two Python start-ups.
    assert main(flags + ["--checkpoint.create_seed_checkpoint"]) == 0
    capsys.readouterr()
    assert main(flags + ["--model.n_layers", "2", "--training.steps", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    seed = tmp_path / "checkpoint" / "step-0"
    assert line.startswith(
        f"error: checkpoint {seed} does not fit llama3/debugmodel with model.n_layers 2: it holds layers.2."
    ), line
    assert line.endswith("which this model lacks; check model.name and model.flavor"), line
