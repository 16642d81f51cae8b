"""The model as a library: what titanlite.load gives, and what the two commands (titanlite/generate.py,
titanlite/eval.py), the in-loop [eval] (titanlite/evaluation/) and GRPO's rollouts (titanlite/rl/) build on:

- load.py: titanlite.load, the model a folder holds built in this process (no process group), as an LM
- api.py: LM, generate and logits, the Python API the commands, the lm-eval model and the in-loop samples go through
- arguments.py: the API's arguments checked, one sentence each
- model.py: a job's model with its weights for the commands, sharded under torchrun (InferenceModel)
- decode.py: the decode loop on the static KV cache (models/kv_cache.py): the whole token step (forward, pick,
  bookkeeping) compiled, replayed from a CUDA graph on CUDA; the host looking every 16 steps; stop tokens and strings
- sampling.py: greedy, temperature, top-k, top-p, min_new_tokens, a counter-based random stream per prompt
- prompts.py: prompts files read and checked, prompts rendered as training renders them
- lm_eval_model.py: TitanliteLM, the lm-eval model (imports lm-eval)
- tasks.py: lm-eval tasks checked, run and their results written; metrics as scalars

lm-eval is imported only where evaluation runs (lm_eval_model.py, and inside the functions of the others).
"""
