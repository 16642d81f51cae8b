"""An environment for agents (rl.environment = "path/file.py:Factory"), with TRL 1.16's meanings (GRPOTrainer's
`environment_factory`).

The factory (a class, or any callable returning an instance) makes one instance per rollout (per completion). Before
the completion is sampled, `reset(**record)` gets the prompt record (`prompt` and its other fields, as TRL passes the
example); it returns None, or text appended to the last user message. The instance's public methods (on its class,
not starting with "_", other than reset and get_reward) are its tools, described and called as rl.tools are
(rl/tools.py). An optional `get_reward()` scores the finished rollout: one more reward, weight 1, named by the class,
which makes rl.reward_functions optional.

An instance's state lives only through its rollout, which one step samples and trains on; a checkpoint does not save
environments, so whatever an environment keeps between steps (a counter, a cache, a remote sandbox) is the user's to
keep or rebuild on resume. The one exception is rl.max_staleness: the episodes sampled ahead and not yet trained on
are saved with their instances (pickled), which get_reward() then scores after the resume.
"""

import inspect
import pickle
from collections.abc import Callable

from titanlite.errors import UserError
from titanlite.rewards.loading import RewardFunction, load_attribute
from titanlite.rl.tools import checked_tool

KEY = "rl.environment"
NOT_TOOLS = ("reset", "get_reward")


def public_methods(cls: type) -> list[str]:
    """The names of the class's tools, as TRL lists them (on the class: an instance's properties are not run)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


class Environment:
    """rl.environment's factory, checked on one instance made at start-up: a callable reset, tools that can be
    described (typed, with docstrings), and whether it scores its rollouts."""

    def __init__(self, spec: str):
        self.name, self.factory = load_attribute(spec, KEY)
        if not callable(self.factory):
            raise UserError(
                f"{KEY} {spec!r} names a {type(self.factory).__name__}, which cannot make environments; name "
                "a class (or a function returning an instance) with a reset method"
            )
        probe = self.make(spec)
        cls = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise UserError(
                f"{KEY} {spec!r} makes {cls.__name__} instances without a reset method, which TRL's "
                "environments define; add reset(self, **kwargs) returning None or text for the prompt"
            )
        self.cls_name = cls.__name__
        self.scores = callable(getattr(probe, "get_reward", None))
        self.schemas = [
            checked_tool(name, getattr(probe, name), f"{KEY} {spec!r}'s method {name}")[2]
            for name in public_methods(cls)
        ]
        self.spec = spec

    def make(self, spec: str | None = None):
        try:
            return self.factory()
        except Exception as error:
            raise UserError(
                f"{KEY} {spec or self.spec!r} failed to make an environment ({type(error).__name__}: "
                f"{error}); fix the factory"
            ) from None

    def check_picklable(self, staleness: int) -> None:
        """With rl.max_staleness, a checkpoint holds the episodes sampled ahead, each with its instance (pickled, as
        the rollout stage's state is), so that a resume scores them as the uninterrupted run does."""
        try:
            pickle.dumps(self.make())
        except Exception as error:
            raise UserError(
                f"{KEY} {self.spec!r} makes instances that cannot be pickled ({type(error).__name__}: {error}), "
                f"and rl.max_staleness {staleness} saves the episodes sampled ahead with their environments in "
                "each checkpoint; make the instances picklable (open connections in reset) or set "
                "rl.max_staleness 0"
            ) from None

    @staticmethod
    def tools_of(instance) -> dict[str, Callable]:
        """The instance's tools by name: its bound public methods."""
        return {name: getattr(instance, name) for name in public_methods(type(instance))}

    def reward(self) -> RewardFunction | None:
        """get_reward() of each rollout's instance as a reward function (weight 1, named by the class), as TRL adds
        it."""
        if not self.scores:
            return None

        def get_reward(environments: list, **kwargs) -> list:
            return [environment.get_reward() for environment in environments]

        return RewardFunction(spec=f"{self.spec} get_reward", name=self.cls_name, function=get_reward)
