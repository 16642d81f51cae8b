"""fault_tolerance.semi_sync_method diloco: each group steps its own (inner) optimizer every step, with no collective
between groups; after every sync_steps of its optimizer steps, torchft's DiLoCo (hooked on that optimizer while the
loop runs in `synchronizing()`) holds the quorum, where a late or restarted group recovers from a peer, averages the
pseudo-gradients (how far each group's weights moved since the last synchronization) and applies them with the
outer Nesterov SGD. A synchronization that does not commit leaves every group at the weights of the last one that
did: its sync_steps steps of updates are dropped, their data is not read again. The outer SGD's momentum is in the
checkpoint, beside the optimizer, and travels to a recovering peer with the other checkpoint objects."""

import contextlib
import time

import torch

from titanlite.errors import UserError
from titanlite.fault_tolerance.replicas import ReplicaGroups
from titanlite.fault_tolerance.torchft_adapter import commit_failures, new_diloco
from titanlite.log import logger


class DiLoCoGroups(ReplicaGroups):
    # the quorum is held in the optimizer's step: a wait that ends raises QuorumEnded out of train_step, after the
    # inner update and before the schedule's step; the loop saves the last counted step, holding this group's own
    # weights, as a preemption between two synchronizations does
    quorum_inside_step = True

    def outer_optimizer(self, model):
        """The outer SGD over the trained parameters, made before the checkpoint's load, which may restore its
        momentum."""
        cfg = self.cfg
        trained = [param for param in model.parameters() if param.requires_grad]
        self.outer = torch.optim.SGD(
            trained, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0
        )
        return self.outer

    def check(self, model, dataloader) -> None:
        if getattr(model, "take_step_loads", None) is not None:
            raise UserError(
                "fault_tolerance.semi_sync_method diloco with a model that balances its experts by routing bias "
                "(deepseek_v3) is not supported (the biases are no parameters, so DiLoCo would never average "
                "them); set fault_tolerance.semi_sync_method none"
            )
        super().check(model, dataloader)

    def join(self, info, init_timeout_s: int, *, model, dataloader, objects: dict, write_scalars, stopping) -> None:
        super().join(
            info,
            init_timeout_s,
            model=model,
            dataloader=dataloader,
            objects=objects,
            write_scalars=write_scalars,
            stopping=stopping,
        )
        self.optimizer = objects["optimizer"].optimizer
        # made after the checkpoint's load: DiLoCo keeps the weights it starts from as the first global ones
        self.diloco = new_diloco(self.manager, model, self.optimizer, self.outer, self.cfg.sync_steps)
        self.inner_steps, self.began = 0, 0.0

    def manager_step(self) -> int:
        return self.train_state.step // self.cfg.sync_steps  # the Manager counts synchronizations

    @contextlib.contextmanager
    def synchronizing(self):
        """DiLoCo's hooks on the inner optimizer, then ours (to see each synchronization's outcome), removed after."""
        with self.diloco:
            hooks = [
                self.optimizer.register_step_pre_hook(self.before_inner_step),
                self.optimizer.register_step_post_hook(self.after_inner_step),
            ]
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()

    def start_step(self, step: int) -> bool:
        """No quorum before a step: the synchronizations hold them."""
        self.step = step
        return True

    def before_inner_step(self, *_) -> None:
        self.began = time.perf_counter()

    def after_inner_step(self, *_) -> None:
        """After the optimizer's step (and DiLoCo's synchronization, when this step ended an interval): log the
        quorum, a recovery (its seconds: the step's and the synchronization's) and an uncommitted synchronization."""
        self.inner_steps += 1
        if self.inner_steps % self.cfg.sync_steps:
            return
        step = self.train_state.step + 1  # the loop's count of this step is not made yet (a recovery set the peer's)
        self.quorum_began = self.began
        if self.jump is not None:
            logger.info(
                f"step: {step}  this group's own step before the recovery is not logged (its loss is of the "
                "weights it replaced)"
            )
        self.note_quorum(step)
        if commit_failures(self.manager):
            self.uncommitted += 1
            logger.warning(
                f"step: {step}  synchronization not committed: every group is back at the weights of the last "
                f"committed one ({self.uncommitted} uncommitted in this run)"
            )
            self.write_scalars(step, {"fault_tolerance/uncommitted_steps": self.uncommitted}, flush=True)

    def average(self, model, loss: torch.Tensor, expert_loads: torch.Tensor | None = None) -> None:
        """Nothing between groups at a step: the synchronizations average the weights' moves instead."""

    def should_commit(self) -> bool:
        return True  # a group's own (inner) step always applies
