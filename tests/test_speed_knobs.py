"""Every speed and memory knob is a config key, set from TOML or from the command line."""

from titanlite.config import load_config

TOML = """
[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"
offload_activations = true

[compile]
enable = true
components = ["model"]
backend = "aot_eager"

[quantize.linear.float8]
enable = true
recipe_name = "rowwise"
filter_fqns = ["output", "router"]

[profiling]
enable_profiling = true
profile_freq = 5
enable_memory_snapshot = true

[parallelism]
fsdp_cpu_offload = true

[training]
param_dtype = "bfloat16"

[optimizer]
name = "AdamWBF16Kahan"
"""


def test_knobs_from_toml_and_cli(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(TOML)
    cfg = load_config(
        [
            "--job.config_file",
            str(path),
            "--compile.components",
            "model,loss",
            "--float8.enable_fsdp_float8_all_gather",
            "--activation_checkpoint.mode",
            "full",
        ]
    )
    ac, compile_, float8, profiling = cfg.activation_checkpoint, cfg.compile, cfg.float8, cfg.profiling
    assert (ac.mode, ac.selective_ac_option, ac.offload_activations) == ("full", "2", True)
    assert (compile_.enable, compile_.components, compile_.backend) == (True, ["model", "loss"], "aot_eager")
    assert (float8.enable, float8.recipe_name, float8.filter_fqns) == (True, "rowwise", ["output", "router"])
    assert float8.enable_fsdp_float8_all_gather
    assert (profiling.enable_profiling, profiling.profile_freq, profiling.enable_memory_snapshot) == (True, 5, True)
    assert cfg.parallelism.fsdp_cpu_offload and cfg.training.param_dtype == "bfloat16"
    assert cfg.optimizer.name == "AdamWBF16Kahan"
