"""What a generator rank of rl.generator_ranks runs instead of training (the protocol: rl/generator.py).

It builds the tokenizer and the model's shape as the trainers do, but no weights: the first request brings them
(trainer 0's broadcast, into a whole model in the dtypes the trainers' copy decodes in), so it loads no checkpoint,
also on a resume, and writes none. It decodes each request of its trainers (t % N == its index) as one batch, in the
order they were sent, under the precision the trainers decode in, and exits once the trainers' run has ended. A stop
signal (SIGTERM, torchrun's forwarding of one) ends the decode in flight at its next token: its trainer then stops
the rollout as a colocated one stops.
"""

import itertools
import pickle

import torch
from torch import nn

from titanlite.checkpoint.stopping import StopFlags
from titanlite.config_sections import JobConfig
from titanlite.data.tokenizer import build_tokenizer
from titanlite.inference.decode import generate_ids
from titanlite.log import init_logger, logger
from titanlite.models import get_model_spec
from titanlite.models.construct import meta_model, model_args
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.dist import DistInfo
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.rl.engine import RolloutStopped, Stoppable, completion, set_tensor
from titanlite.rl.generator import STOPPED, as_bytes, fetch


class Generator:
    """One generator rank's model, held between requests, and how it decodes."""

    def __init__(self, cfg: JobConfig, info: DistInfo, stop: StopFlags):
        self.cfg, self.link, self.device = cfg, info.generators, info.device
        self.store = self.link.run_store
        self.tokenizer = build_tokenizer(cfg.model)
        self.spec = get_model_spec(cfg.model.name)
        # build.py's resolve_model_args for GRPO, whose rows never reset positions (the trainers check the context)
        self.args = model_args(cfg.model, self.spec, self.tokenizer.vocab_size)
        self.dims = ParallelDims.from_config(cfg.parallelism, self.link.trainers)  # the trainers': autocast or not
        self.stop = stop
        self.model: nn.Module | None = None
        self.tensors: list[torch.Tensor] = []  # the model's, in the order trainer 0 broadcasts them
        self.group = None
        self.held = None  # the policy step of the weights held

    def ended(self) -> bool:
        """The trainers' run has ended (they set the stop key)."""
        return self.store.check(["stop"])

    def receive(self, policy_step: int) -> None:
        """The weights after `policy_step` optimizer steps, broadcast by trainer 0; the model built at the first."""
        if self.model is None:
            manifest = fetch(self.store, "manifest", self.ended, keep=True)
            if manifest is None:
                return
            self.model = meta_model(self.spec, self.args, self.cfg.training.param_dtype, self.cfg.lora).eval()
            for name, shape, dtype, parameter in manifest:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                set_tensor(self.model, name, tensor, parameter)
                self.tensors.append(tensor)
            self.group = self.link.weights_group()
        for tensor in self.tensors:
            self.group.broadcast(as_bytes(tensor), 0).wait()
        self.held = policy_step

    def decode(self, prompts, sampling, indices, policy_step: int):
        """The request's completions, or STOPPED where a stop signal or the run's end cut the decode."""
        stopping = lambda: self.stop.signal is not None or self.ended()  # noqa: E731
        if stopping():
            return STOPPED
        try:
            with mixed_precision_context(self.dims, self.cfg.training.mixed_precision_param, self.device.type):
                generated = generate_ids(
                    Stoppable(self.model, stopping), self.args, self.tokenizer, prompts, sampling, indices=indices
                )
        except RolloutStopped:
            return STOPPED
        return [completion(g, policy_step) for g in generated]


def serve(cfg: JobConfig, info: DistInfo) -> None:
    """A generator rank's run: its trainers' requests answered in order until their run ends."""
    link = info.generators
    link.begin_run()
    init_logger(link.trainers + link.index)
    stop = StopFlags(info.device, check_finite=False)  # SIGTERM and Ctrl-C as the trainers take them
    try:
        generator = Generator(cfg, info, stop)
        mine = [t for t in range(link.trainers) if t % link.count == link.index]
        logger.info(f"generator rank {link.index}: serving trainer ranks {mine}")
        for round_ in itertools.count():
            for trainer in mine:
                request = fetch(link.run_store, f"request/{trainer}/{round_}", generator.ended)
                if request is None:
                    return
                prompts, sampling, indices, policy_step = request
                if policy_step != generator.held:
                    generator.receive(policy_step)
                reply = generator.decode(prompts, sampling, indices, policy_step)
                link.run_store.set(f"reply/{trainer}/{round_}", pickle.dumps(reply))
    finally:
        stop.close()
