"""In-loop evaluation ([eval]): lm-eval tasks and sample prompts on the live model every eval.interval steps
and after the last (eval.at_end).

Every rank takes part: the data-parallel ranks share the requests as lm-eval shares them (lm_eval_model.py, in
lockstep, as a sharded model's collectives need), and lm-eval gathers the values to rank 0, the same values one
process gets. Scalars go to TensorBoard as eval/<task>/<metric> and to
the console; sample prompts' greedy completions to TensorBoard's text tab. The seconds spent are printed and
left out of the next tps and MFU.

The trainer builds the evaluator only when [eval] evaluates (eval.interval or eval.at_end): then the task names
are checked when it is built, before step 1, and lm-eval is imported for that; a run without [eval] never
imports it.
"""

import time

import torch

from titanlite.inference.api import LM
from titanlite.inference.decode import Sampling
from titanlite.inference.prompts import read_prompt_lines, render_prompts
from titanlite.inference.tasks import evaluate_tasks, metric_scalars, task_manager
from titanlite.log import logger


class InLoopEvaluator:
    def __init__(self, run, training):
        """The [eval] section of `run` (build.py's Run, or an InferenceModel), on its tokenizer and model args
        (max_seq_len, sliding_window), written to `training`'s metrics (build.py's Training, or anything with its
        metrics and steps); at_end evaluates after its last step. Sample prompts given as messages take
        training.chat_template."""
        self.run, self.cfg, self.tokenizer, self.args = run, run.cfg.eval, run.tokenizer, run.args
        self.metrics, self.last_step = training.metrics, training.steps
        cfg = self.cfg
        # Checked now: a bad task name, file or prompt stops the run before its first step, not at the first evaluation.
        if cfg.tasks:
            task_manager(tuple(cfg.tasks), cfg.include_path or None)
        records = read_prompt_lines(cfg.sample_prompts, key="eval.sample_prompts") if cfg.sample_prompts else []
        self.samples = render_prompts(records, run.tokenizer, run.cfg.training.chat_template)

    def should_evaluate(self, step: int) -> bool:
        return bool(self.cfg.interval and step % self.cfg.interval == 0) or (self.cfg.at_end and step == self.last_step)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """{task/metric: value} of eval.tasks on the run's model (back in training mode after; {} on ranks other than
        0), also written as eval/<task>/<metric> scalars; the sample prompts' completions to the text tab."""
        model = self.run.model
        started, was_training = time.perf_counter(), model.training
        model.eval()
        try:
            # compile.enable compiles the blocks for training's shapes; lm-eval's batches and a decode step per token
            # would recompile them past dynamo's limit (every length is a new shape), so evaluation runs them eagerly.
            with torch.compiler.set_stance("force_eager"):
                scalars = self.tasks_and_samples(step)
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - started
        values = "  ".join(f"{name}: {value:.4f}" for name, value in scalars.items())
        logger.info(f"eval step: {step}  {values}  time: {seconds:.2f}s")
        self.metrics.started += seconds  # evaluation is not training time: the next tps and MFU leave it out
        return scalars

    def tasks_and_samples(self, step: int) -> dict[str, float]:
        scalars = {}
        if self.cfg.tasks:
            from titanlite.inference.lm_eval_model import TitanliteLM

            lm = TitanliteLM(self.run, batch_size=self.cfg.batch_size)
            results = evaluate_tasks(
                lm,
                self.cfg.tasks,
                self.cfg.include_path or None,
                limit=None if self.cfg.limit == -1 else self.cfg.limit,
                num_fewshot=None if self.cfg.num_fewshot == -1 else self.cfg.num_fewshot,
                fewshot_key="eval.num_fewshot",
            )
            # lm-eval hands the results to rank 0 only (the one that logs); None elsewhere.
            scalars = metric_scalars(results) if results is not None else {}
        self.metrics.write_scalars(step, {f"eval/{name}": value for name, value in scalars.items()}, flush=True)
        if self.samples:
            self.write_samples(step)
        return scalars

    def write_samples(self, step: int) -> None:
        completions = LM.of(self.run).complete(self.samples, Sampling(self.cfg.max_new_tokens))
        if self.metrics.writer is None:
            return
        for number, completion in enumerate(completions):
            self.metrics.writer.add_text(
                f"eval/sample/{number}", f"{completion.prompt}\n\n---\n\n{completion.text}", step
            )
