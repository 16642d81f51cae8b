"""titanlite: a small PyTorch-native LLM training framework.

`titanlite.load(path)` (titanlite/inference/load.py) is imported on first use: importing titanlite stays cheap."""


def load(path, device=None, dtype=None, compile: bool = False, allow_unverified: bool = False):
    """The model at `path` (a Hugging Face folder, a checkpoint step-N folder or a run's dump folder) as an LM that
    generates (lm.generate) and scores (lm.logits), built in this process (no process group); see
    titanlite/inference/load.py and docs/evaluation.md."""
    from titanlite.inference.load import load as load_model

    return load_model(path, device=device, dtype=dtype, compile=compile, allow_unverified=allow_unverified)
