"""titanlite: a small PyTorch-native LLM training framework.

`titanlite.load(path)` (titanlite/inference/api.py) is imported on first use: importing titanlite stays cheap."""


def load(path, compile: bool = False, dtype=None, device: str = "auto"):
    """The model at `path` (a Hugging Face folder, a checkpoint step-N folder or a run's dump folder) as an LM that
    generates (lm.generate) and scores (lm.logits); see titanlite/inference/api.py and docs/evaluation.md."""
    from titanlite.inference.api import load as load_model

    return load_model(path, compile=compile, dtype=dtype, device=device)
