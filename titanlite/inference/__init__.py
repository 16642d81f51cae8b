"""Generation and evaluation on a trained model, a library the two entry points (titanlite/generate.py,
titanlite/eval.py) and the trainer's in-loop [eval] call:

- model.py: the model with its weights, built from the [model] section and stopped before the loss (InferenceModel)
- api.py: titanlite.load and LM, the Python API the two entry points, the lm-eval model and the in-loop samples go through
- decode.py: the decode loop (static KV cache of models/kv_cache.py, the host looking every 16 steps), greedy or sampled, stop tokens and strings
- prompts.py: prompts files read and checked, prompts rendered as training renders them
- generate_job.py: python -m titanlite.generate's prompts in, JSON lines out
- lm_eval_model.py: TitanliteLM, the lm-eval model (imports lm-eval)
- tasks.py: lm-eval tasks checked, run and their results written; metrics as scalars
- eval_job.py: python -m titanlite.eval's config, evaluation and results table
- evaluator.py: the in-loop evaluator ([eval]) on the trainer's live model

lm-eval is imported only where evaluation runs (lm_eval_model.py, and inside the functions of the others).
"""
