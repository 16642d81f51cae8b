"""Multi-turn episodes for agents (rl.tools, rl.environment), as TRL 1.16's GRPOTrainer runs its tool-calling loop.

An episode starts from its prompt, rendered through the chat template with the tools' schemas (after rl.environment's
reset, which may add text to the last user message). Each turn the RolloutEngine samples the model's next tokens after
everything so far; the calls in the turn (rl/tools.py) are answered, the `tool` messages rendered through the template
as TRL renders them (the tokens a template writes after an assistant turn that called tools, with those messages and
the generation prompt) and appended, and the model goes on, for at most rl.max_tool_calling_iterations rounds of calls.

The whole completion (everything after the prompt: the model's turns and the inserted tool turns) holds at most
rl.max_new_tokens tokens, as TRL's max_completion_length bounds it, and the prompt and completion at most
training.seq_len + 1 (one trained row). Tool results that would not fit (with room for one more token of the model)
are cut, and the cut is said in the result itself, in the log (once) and in rl/tool_results_cut; results that do not
fit even empty end the episode, as TRL drops them.

An `Episode` is a Completion whose ids are the whole completion, with a mask (1 = the model's own token, trained;
0 = inserted by the template or the environment, never a label) and the sampler's log-probabilities (0 where
inserted).
"""

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titanlite.config_sections import RL
from titanlite.data.chat import ChatRenderer
from titanlite.errors import UserError
from titanlite.inference.decode import Sampling
from titanlite.log import logger
from titanlite.rewards.loading import load_reward_functions
from titanlite.rl.engine import Completion, RolloutEngine
from titanlite.rl.environment import Environment
from titanlite.rl.tools import CALL, answer, load_tools, parse_tool_calls

# Turn t of a completion samples from the stream of index + t x TURN_STRIDE (inference/sampling.py's prompt_seed), so
# that its turns draw unrelated random numbers and any layout draws the same.
TURN_STRIDE = 2**40
CUT_NOTE = " [cut: the rest of the result did not fit the completion]"
PROBE_RESULT = "titanlite probe result"


@dataclass(frozen=True)
class Episode(Completion):
    """A completion of several turns: ids, logprobs and mask cover the whole completion after the prompt."""

    prompt_ids: list[int] = field(default_factory=list)  # the prompt as rendered for this episode (with the tools)
    mask: list[int] = field(default_factory=list)  # per sampled_ids token: 1 the model's, 0 inserted
    messages: list[dict] = field(
        default_factory=list
    )  # the completion as messages (assistant, tool, ...), as TRL has it
    tool_calls: list[dict] = field(default_factory=list)  # each call answered: name, arguments, result, failed
    results_cut: int = 0  # tool results cut to fit
    environment: object = None  # rl.environment's instance for this rollout


class Tools:
    """The tools of a run, loaded and checked at start-up: rl.tools, and rl.environment's factory and methods."""

    def __init__(self, rl: RL):
        self.rl = rl
        self.standalone = load_tools(rl.tools)
        self.environment = Environment(rl.environment) if rl.environment else None
        if self.environment is not None and rl.max_staleness:
            self.environment.check_picklable(rl.max_staleness)
        self.schemas = [schema for _, _, schema in self.standalone] + (
            self.environment.schemas if self.environment else []
        )

    @property
    def enabled(self) -> bool:
        return bool(self.schemas) or self.environment is not None

    def rewards(self) -> list:
        """rl.reward_functions, then the environment's get_reward where it has one; at least one of them."""
        functions = load_reward_functions(self.rl.reward_functions) if self.rl.reward_functions else []
        reward = self.environment.reward() if self.environment else None
        if not functions and reward is None:
            raise UserError(
                f"rl.reward_functions is empty and rl.environment {self.rl.environment!r} has no get_reward "
                "method, so nothing scores the rollouts; set rl.reward_functions or add get_reward()"
            )
        return functions + ([reward] if reward else [])


@dataclass
class Trace:
    """One episode as it is sampled."""

    prompt_ids: list[int]
    budget: int  # tokens the completion may hold
    tools: dict[str, Callable]
    environment: object
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    cut: int = 0
    finish: str = "length"
    stop: int | None = None
    policy_step: int = 0
    last_text: str = ""

    def take(self, completion: Completion, tokenizer) -> None:
        """A turn of the model's, cut to the budget left."""
        room = self.budget - len(self.ids)
        new, logprobs = completion.sampled_ids, completion.logprobs
        self.finish, self.stop = completion.finish_reason, completion.stop_token
        if len(new) > room:
            new, logprobs, self.finish, self.stop = new[:room], logprobs[:room], "length", None
        self.ids += new
        self.mask += [1] * len(new)
        self.logprobs += logprobs
        self.policy_step = completion.policy_step
        self.last_text = tokenizer.decode(new[:-1] if self.stop is not None else new)
        calls = [call.as_message() for call in parse_tool_calls(self.last_text) if call.error is None]
        message = {"role": "assistant", "content": CALL.sub("", self.last_text).strip()}
        self.messages.append(message | ({"tool_calls": calls} if calls else {}))

    def insert(self, ids: list[int], messages: list[dict]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.messages += messages

    def episode(self) -> Episode:
        ids = self.ids[:-1] if self.stop is not None else self.ids
        return Episode(
            ids,
            self.stop,
            self.finish,
            self.logprobs,
            self.policy_step,
            prompt_ids=self.prompt_ids,
            mask=self.mask,
            messages=self.messages,
            tool_calls=self.calls,
            results_cut=self.cut,
            environment=self.environment,
        )


def cut_contents(messages: list[dict], keep: int) -> list[dict]:
    return [m | {"content": m["content"][:keep] + CUT_NOTE} if len(m["content"]) > keep else m for m in messages]


class Agents:
    """The rollout stage's episodes: the tools checked against the chat template, then roll_out()."""

    def __init__(self, tools: Tools, tokenizer, chat_template: str, seq_len: int):
        self.tools, self.rl, self.tokenizer, self.seq_len = tools, tools.rl, tokenizer, seq_len
        self.renderer = ChatRenderer(tokenizer, chat_template)
        self.limit = self.rl.max_tool_calling_iterations if self.rl.max_tool_calling_iterations != -1 else None
        self.cut_said = False
        self.check_template()

    def check_template(self) -> None:
        """The template renders the tools' schemas and a tool message; it is asked once, at start-up."""
        name = self.tools.schemas[0]["function"]["name"] if self.tools.schemas else "probe"
        shown = self.renderer.render([{"role": "user", "content": "probe"}], True, tools=self.tools.schemas or None)
        if self.tools.schemas and name not in shown:
            raise UserError(
                f"the chat template of {self.renderer.origin} writes nothing of the tools it is given, so the "
                "model would never see them; set training.chat_template to a template that renders tools "
                "(such as Qwen3's)"
            )
        calls = [{"type": "function", "function": {"name": name, "arguments": {}}}]
        turns = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "name": name, "content": PROBE_RESULT},
        ]
        if PROBE_RESULT not in self.renderer.render(turns, True):
            raise UserError(
                f"the chat template of {self.renderer.origin} does not write a tool message's content, so the "
                "model would never read the tools' results; set training.chat_template to a template that "
                "renders tool messages (such as Qwen3's)"
            )

    def check_prompts(self, prompts: list) -> None:
        if any(isinstance(prompt, str) for prompt in prompts):
            raise UserError(
                'rl.tools and rl.environment give the chat template tools, so every prompt record\'s "prompt" '
                'must be a list of messages, not text; write the prompts as [{"role": "user", ...}]'
            )

    def suffix_ids(self, messages: list[dict]) -> list[int]:
        """The tokens a template writes after an assistant turn of tool calls ended by its end-of-turn token (the
        tokenizer's eos): the tool messages and the generation prompt. As TRL's _get_tool_suffix_ids, a short
        conversation is rendered with and without them; what follows the turns it had without them (counted by their
        eos tokens: a template such as Qwen3's writes the last assistant turn otherwise once turns follow it) is the
        suffix."""
        calls = [{"type": "function", "function": {"name": messages[0].get("name", "tool"), "arguments": {}}}]
        before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        eos = self.tokenizer.eos_id
        turns = self.tokenizer.encode(self.renderer.render(before), bos=False, eos=False).count(eos)
        full = self.tokenizer.encode(self.renderer.render(before + messages, True), bos=False, eos=False)
        ends = [i for i, token in enumerate(full) if token == eos]
        if turns == 0 or len(ends) < turns:
            raise UserError(
                f"the chat template of {self.renderer.origin} does not end its turns with the tokenizer's eos, "
                "so the tokens of a tool message cannot be appended to a completion; set "
                "training.chat_template to a template that does (such as Qwen3's)"
            )
        return full[ends[turns - 1] + 1 :]

    def start(self, item) -> Trace:
        """An episode's trace: its environment made and reset, its prompt rendered with the tools."""
        environment = self.tools.environment.make() if self.tools.environment else None
        messages = copy.deepcopy(item.prompt)
        tools = {name: function for name, function, _ in self.tools.standalone}
        if environment is not None:
            tools |= Environment.tools_of(environment)
            observation = environment.reset(**copy.deepcopy({"prompt": item.prompt} | item.fields))
            if observation is not None and not isinstance(observation, str):
                raise UserError(
                    f"rl.environment {self.rl.environment!r}: reset() returned a {type(observation).__name__}; "
                    "return None or text to append to the last user message"
                )
            if observation:
                messages[-1] = messages[-1] | {"content": messages[-1]["content"] + observation}
        text = self.renderer.render(messages, True, tools=self.tools.schemas)
        ids = self.tokenizer.encode(text, bos=False, eos=False)
        budget = min(self.rl.max_new_tokens, self.seq_len + 1 - len(ids))
        if budget < 1:
            raise UserError(
                f"a prompt rendered with the tools holds {len(ids)} tokens, leaving no room for a completion "
                f"in training.seq_len {self.seq_len}; raise training.seq_len or shorten the prompts"
            )
        return Trace(ids, budget, tools, environment)

    def roll_out(
        self, engine: RolloutEngine, items: list, groups: int, sampling: Sampling, indices: list[int]
    ) -> list[Episode]:
        """groups episodes of each item, completion k sampled from indices[k]'s streams (one per turn)."""
        with getattr(engine, "held", contextlib.nullcontext)():  # the colocated engine gathers the weights once
            return self.episodes(engine.generate, items, groups, sampling, indices)

    def episodes(
        self, generate: Callable[..., list[Completion]], items: list, groups: int, sampling: Sampling, indices: list
    ) -> list[Episode]:
        """roll_out()'s episodes, each turn sampled by generate(prompts, sampling, indices): an engine's generate, or
        (rl.max_staleness) ColocatedEngine.submit_turns' decode of the weights it copied, on the engine's thread."""
        traces = [self.start(item) for item in items for _ in range(groups)]
        self.turns(generate, traces, sampling, indices)
        return [trace.episode() for trace in traces]

    def turns(self, generate: Callable, traces: list[Trace], sampling: Sampling, indices: list[int]) -> None:
        active, turn = list(range(len(traces))), 0
        while active:
            room = max(traces[k].budget - len(traces[k].ids) for k in active)
            completions = generate(
                [traces[k].prompt_ids + traces[k].ids for k in active],
                dataclasses.replace(sampling, max_new_tokens=room),
                [indices[k] + turn * TURN_STRIDE for k in active],
            )
            for k, completion in zip(active, completions):
                traces[k].take(completion, self.tokenizer)
            if self.limit is not None and turn == self.limit:
                break
            active = [k for k in active if self.answer_calls(traces[k])]
            turn += 1

    def answer_calls(self, trace: Trace) -> bool:
        """The calls of the trace's last turn answered and appended; whether the model goes on."""
        calls = parse_tool_calls(trace.last_text)
        if not calls or trace.finish != "eos":
            return False
        messages = []
        for call in calls:
            content, failed = answer(call, trace.tools, self.rl.tool_timeout_seconds)
            trace.calls.append({"name": call.name, "arguments": call.arguments, "result": content, "failed": failed})
            messages.append({"role": "tool", "name": call.name or "unknown", "content": content})
        room = trace.budget - len(trace.ids) - 1  # and one token of the model's after them
        suffix = self.suffix_ids(messages)
        if len(suffix) > room:
            messages, suffix = self.fitted(messages, room)
            if suffix is None:  # answered, but the answers are not given: the episode ends (as TRL drops them)
                for record in trace.calls[-len(calls) :]:
                    record["result"] = None
                return False
            trace.cut += 1
        trace.insert(suffix, messages)
        return True

    def fitted(self, messages: list[dict], room: int) -> tuple[list[dict], list[int] | None]:
        """The tool messages with their contents cut to the longest that fits `room` tokens (None: not even empty)."""
        low, high, best = 0, max(len(m["content"]) for m in messages) - 1, (messages, None)
        while low <= high:
            keep = (low + high) // 2
            cut = cut_contents(messages, keep)
            suffix = self.suffix_ids(cut)
            if len(suffix) <= room:
                best, low = (cut, suffix), keep + 1
            else:
                high = keep - 1
        if best[1] is not None and not self.cut_said:
            logger.warning(
                "a tool result was cut to fit rl.max_new_tokens and training.seq_len (the model reads that it "
                "was); rl/tool_results_cut counts them"
            )
            self.cut_said = True
        return best


def tool_stats(episodes: list[Episode]) -> dict[str, float]:
    """TRL's tool metrics over every rank's episodes: rl/tool_calls, calls answered per completion (its
    tools/call_frequency); rl/tool_failures, the share of them that failed (tools/failure_frequency); and
    rl/tool_results_cut, results cut to fit, per completion."""
    counts = torch.tensor(
        [
            len(episodes),
            sum(len(e.tool_calls) for e in episodes),
            sum(c["failed"] for e in episodes for c in e.tool_calls),
            sum(e.results_cut for e in episodes),
        ],
        dtype=torch.float64,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    completions, calls, failures, cut = counts.tolist()
    return {
        "rl/tool_calls": calls / completions,
        "rl/tool_failures": failures / calls if calls else 0.0,
        "rl/tool_results_cut": cut / completions,
    }
