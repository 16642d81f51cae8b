"""Evaluation inside the training loop ([eval]): in_loop.py's InLoopEvaluator runs lm-eval tasks and sample prompts
on the trainer's live model through the inference library (titanlite/inference/). A room of its own rather than part
of metrics/: the checkpoint imports metrics/ and the inference library imports the checkpoint, so there it would
close a cycle."""
