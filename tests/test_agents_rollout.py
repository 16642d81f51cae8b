"""Agents (rl.tools, rl.environment) end to end on the real ColocatedEngine: a tiny model that calls add(2, 3) at every
turn (tests/agent_tools.py), Qwen3's chat template, real tools and a real environment. Checked: the episode's tokens
(the model's, then the tool turn the template renders, then the model's again), the mask and the labels (inserted
tokens never train), rollouts.jsonl and the rl/tool_* scalars, rl.max_tool_calling_iterations, the token budget
(results cut, and said), a hung tool stopped after rl.tool_timeout_seconds, a tool that raises, the environment's
reset and reward; errors are one sentence."""

import json
import time
import types
from pathlib import Path

import pytest
import torch
from agent_tools import CALL, calling_model, prompts_file
from conftest import ON_CPU, run_test_script, tensorboard_scalars
from qwen3_template import QWEN3_TEMPLATE

from titanlite.config_sections import RL
from titanlite.inference.sampling import Sampling
from titanlite.loss import IGNORED
from titanlite.rl.engine import ColocatedEngine
from titanlite.rl.episode import CUT_NOTE, Agents, Tools
from titanlite.rl.prompts import PromptItem
from titanlite.rl.rows import masked_labels
from titanlite.train import main

TOOLS = "tests/agent_tools.py"
# episodes in tests/agent_tools.py's calculator environment, with a checkpoint at step 2 that a resume can continue
CALCULATOR_RESUMABLE = [
    "--rl.environment",
    f"{TOOLS}:Calculator",
    "--rl.max_new_tokens",
    "64",
    "--rl.max_tool_calling_iterations",
    "2",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.last_save_model_only",
    "false",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    (root / "qwen3.jinja").write_text(QWEN3_TEMPLATE)
    return calling_model(root / "model", QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def lm(folder):
    import titanlite

    return titanlite.load(str(folder), device="cpu")


def roll_out(lm, folder, rl: RL, groups: int = 2, seq_len: int = 512):
    agents = Agents(Tools(rl), lm.tokenizer, str(folder.parent / "qwen3.jinja"), seq_len)
    engine = ColocatedEngine(types.SimpleNamespace(model=lm.model, args=lm.args, tokenizer=lm.tokenizer))
    item = PromptItem(0, [{"role": "user", "content": "What is 2 + 3?"}], [], {"answer": "5"})
    return agents, agents.roll_out(
        engine, [item], groups, Sampling(rl.max_new_tokens, 1.0, seed=0), list(range(groups))
    )


def test_an_episode_is_the_models_turns_and_the_rendered_tool_turns(lm, folder):
    rl = RL(tools=[f"{TOOLS}:add"], max_new_tokens=200, max_tool_calling_iterations=2)
    agents, episodes = roll_out(lm, folder, rl)
    tokenizer, call = lm.tokenizer, lm.tokenizer.encode(CALL, bos=False, eos=False)
    tool_turn = agents.suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    assert (
        tokenizer.decode(tool_turn)
        == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    turn = call + [tokenizer.eos_id]
    for episode in episodes:  # 3 turns of the model, 2 rounds of calls answered (the limit), then the episode ends
        assert episode.sampled_ids == turn + tool_turn + turn + tool_turn + turn
        assert episode.mask == [1, 1] + [0] * len(tool_turn) + [1, 1] + [0] * len(tool_turn) + [1, 1]
        assert episode.finish_reason == "eos" and episode.stop_token == tokenizer.eos_id
        assert len(episode.logprobs) == len(episode.mask)
        assert all(p == 0.0 for p, m in zip(episode.logprobs, episode.mask) if m == 0)
        assert all(-1e-6 < p <= 0.0 for p, m in zip(episode.logprobs, episode.mask) if m == 1)  # certain tokens
        assert [c["result"] for c in episode.tool_calls] == ["5", "5"] and not any(
            c["failed"] for c in episode.tool_calls
        )
        assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
        expected = lm.tokenizer.encode(
            agents.renderer.render([{"role": "user", "content": "What is 2 + 3?"}], True, tools=agents.tools.schemas),
            bos=False,
            eos=False,
        )
        assert episode.prompt_ids == expected and '"name": "add"' in tokenizer.decode(expected)
    labels = torch.arange(len(expected) + len(episodes[0].sampled_ids))[None, 1:].clone()
    masked = masked_labels(labels.clone(), [expected], episodes[:1])
    trained = (masked != IGNORED)[0, len(expected) - 1 :]
    assert trained.tolist() == [bool(m) for m in episodes[0].mask]


def renamed_tools(tmp_path, tool: str) -> str:
    """The spec of a copy of agent_tools.py whose `tool` is named add, the tool the model calls."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tools = tmp_path / "tools.py"
    tools.write_text(Path(TOOLS).read_text().replace("def add(", "def plain_add(").replace(f"def {tool}(", "def add("))
    return f"{tools}:add"


def test_the_budget_cuts_a_long_result_and_says_so(lm, folder, tmp_path, caplog):
    _, episodes = roll_out(lm, folder, RL(tools=[renamed_tools(tmp_path, "long_answer")], max_new_tokens=120), groups=1)
    episode = episodes[0]  # bounded by training.seq_len 512 here: the result cut to leave the model one token
    assert len(episode.sampled_ids) == min(120, 513 - len(episode.prompt_ids)) == 100 and episode.results_cut == 1
    assert episode.finish_reason == "length" and episode.mask[-2:] == [0, 1] and len(episode.tool_calls) == 1
    assert episode.messages[1]["content"].endswith(CUT_NOTE) and episode.messages[1]["content"].startswith("digits ")
    assert "a tool result was cut to fit rl.max_new_tokens" in caplog.text
    _, episodes = roll_out(lm, folder, RL(tools=[f"{TOOLS}:add"], max_new_tokens=60), groups=1)
    episode = episodes[0]  # the second answer does not fit even cut: it is not given, and the episode ends there
    assert len(episode.sampled_ids) < 60 and episode.mask[-2:] == [1, 1]
    assert [c["result"] for c in episode.tool_calls] == ["5", None] and episode.messages[-1]["role"] == "assistant"


def test_a_hung_tool_is_stopped_and_a_failing_one_answered(lm, folder, tmp_path):
    began = time.perf_counter()
    _, episodes = roll_out(
        lm,
        folder,
        RL(
            tools=[renamed_tools(tmp_path, "sleepy")],
            max_new_tokens=200,
            max_tool_calling_iterations=1,
            tool_timeout_seconds=0.5,
        ),
        groups=1,
    )
    assert time.perf_counter() - began < 10
    assert episodes[0].tool_calls == [
        {
            "name": "add",
            "arguments": {"a": 2, "b": 3},
            "failed": True,
            "result": "{'error': 'the tool did not answer within 0.5 seconds'}",
        }
    ]
    _, episodes = roll_out(
        lm,
        folder,
        RL(tools=[renamed_tools(tmp_path / "b", "broken")], max_new_tokens=200, max_tool_calling_iterations=1),
        groups=1,
    )
    assert episodes[0].tool_calls[0]["result"] == "{'error': 'no sums today'}" and episodes[0].tool_calls[0]["failed"]


def agent_flags(folder, prompts, dump, steps, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--model.hf_assets_path",
        str(folder),
        "--job.dump_folder",
        str(dump),
        "--training.dataset_format",
        "prompts",
        "--training.dataset_path",
        str(prompts),
        "--training.chat_template",
        str(folder.parent / "qwen3.jinja"),
        "--training.seq_len",
        "512",
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--rl.num_generations",
        "2",
        "--rl.max_new_tokens",
        "100",
        "--training.mixed_precision_param",
        "float32",
        "--lr_scheduler.warmup_steps",
        "0",
        "--optimizer.lr",
        "0.001",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--rl.log_rollouts",
        *map(str, extra),
    ]


def test_grpo_with_an_environment_trains_only_the_models_tokens(folder, lm, tmp_path):
    prompts = prompts_file(tmp_path / "prompts.jsonl", 4)
    flags = agent_flags(
        folder,
        prompts,
        tmp_path / "run",
        2,
        "--rl.environment",
        f"{TOOLS}:Calculator",
        "--rl.max_tool_calling_iterations",
        "1",
    )
    assert main(flags) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1] * 4 + [2] * 4
    for line in lines:
        assert line["rewards"] == {"Calculator": 1.0}  # get_reward: the environment's one call answered
        assert len(line["completion_mask"]) == len(line["completion_ids"]) == len(line["logprobs"])
        assert line["completion_mask"][:2] == [1, 1] and line["completion_mask"][-2:] == [1, 1]
        assert line["completion_mask"].count(0) > 10 and [c["result"] for c in line["tool_calls"]] == ["5"]
        answer = line["prompt"][0]["content"].split()[2]  # "What is N + 3?": reset() told the model the answer
        assert f"What is {answer} + 3? (the answer is {int(answer) + 3})<|im_end|>" in lm.tokenizer.decode(
            line["prompt_ids"]
        )
    for tag, value in (("rl/tool_calls", 1.0), ("rl/tool_failures", 0.0), ("rl/reward/Calculator", 1.0)):
        scalars = tensorboard_scalars(tmp_path / "run" / "tb", tag)
        assert scalars == {1: pytest.approx(value), 2: pytest.approx(value)}, (tag, scalars)


@pytest.fixture(scope="module")
def uncertain(tmp_path_factory):
    """A model that calls in about 60% of its samples, so that the environment's rewards differ within a group and
    the steps train."""
    root = tmp_path_factory.mktemp("uncertain")
    (root / "qwen3.jinja").write_text(QWEN3_TEMPLATE)
    return calling_model(root / "model", QWEN3_TEMPLATE, scale=1.2), prompts_file(root / "prompts.jsonl", 8)


def test_lora_trains_an_agent(uncertain, tmp_path):
    folder, prompts = uncertain
    assert (
        main(
            agent_flags(
                folder,
                prompts,
                tmp_path,
                2,
                "--rl.environment",
                f"{TOOLS}:Calculator",
                "--rl.max_new_tokens",
                "64",
                "--lora.rank",
                "4",
                "--lora.target_modules",
                "wq,wv",
                "--optimizer.lr",
                "0.02",
            )
        )
        == 0
    )
    losses = tensorboard_scalars(tmp_path / "tb", "loss/train")
    assert sorted(losses) == [1, 2] and any(abs(v) > 1e-4 for v in losses.values())
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert any(0 in line["completion_mask"] for line in lines)


def test_two_fsdp_ranks_equal_one_process_and_a_resume_is_the_same_run(uncertain, tmp_path):
    """One process (2 micro-batches accumulated) against 2 FSDP ranks, and those ranks resumed from the checkpoint of
    step 2: the same episodes (ids and masks) and the same losses within 1e-5 (fp32); the same at rl.max_staleness 1
    (episodes sampled ahead on the engine's thread, tests/test_agents_async.py), in the same launch."""
    folder, prompts = uncertain
    extra = CALCULATOR_RESUMABLE
    stale = [*extra, "--rl.max_staleness", "1"]
    assert main(agent_flags(folder, prompts, tmp_path / "one", 3, *extra)) == 0
    assert main(agent_flags(folder, prompts, tmp_path / "one_stale", 3, *stale)) == 0
    spec = tmp_path / "runs.json"
    spec.write_text(
        json.dumps(
            [
                {"argv": agent_flags(folder, prompts, tmp_path / "fsdp", 3, *extra)},
                {
                    "argv": agent_flags(folder, prompts, tmp_path / "resumed", 3, *extra),
                    "resume_from": str(tmp_path / "fsdp" / "checkpoint" / "step-2"),
                },
                {"argv": agent_flags(folder, prompts, tmp_path / "fsdp_stale", 3, *stale)},
            ]
        )
    )
    out = run_test_script("layout_runs.py", str(spec), nproc=2, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {
        run: [json.loads(line) for line in (tmp_path / run / "rollouts.jsonl").read_text().splitlines()]
        for run in ("one", "fsdp", "resumed", "one_stale", "fsdp_stale")
    }
    for key in ("completion_ids", "completion_mask", "tool_calls", "rewards"):
        assert [r[key] for r in runs["fsdp"]] == [r[key] for r in runs["one"]], key
        assert [r[key] for r in runs["resumed"] if r["step"] == 3] == [r[key] for r in runs["one"] if r["step"] == 3]
        assert [r[key] for r in runs["fsdp_stale"]] == [r[key] for r in runs["one_stale"]], key
    assert [r["policy_step"] for r in runs["fsdp_stale"]] == [0] * 8 + [1] * 4
    rewards = [r["rewards"]["Calculator"] for r in runs["one"]]
    assert len(set(rewards)) > 1 and 0 in {m for r in runs["one"] for m in r["completion_mask"]}
    for tag in ("loss/train", "rl/reward", "rl/tool_calls"):
        one, fsdp, resumed = (tensorboard_scalars(tmp_path / run / "tb", tag) for run in ("one", "fsdp", "resumed"))
        assert sorted(fsdp) == [1, 2, 3] and all(fsdp[s] == pytest.approx(one[s], abs=1e-5) for s in one), (
            tag,
            one,
            fsdp,
        )
        assert sorted(resumed) == [3] and resumed[3] == pytest.approx(one[3], abs=1e-5), (tag, one, resumed)
        one, fsdp = (tensorboard_scalars(tmp_path / run / "tb", tag) for run in ("one_stale", "fsdp_stale"))
        assert sorted(fsdp) == [1, 2, 3] and all(fsdp[s] == pytest.approx(one[s], abs=1e-5) for s in one), (tag, one)
    assert any(abs(v) > 1e-4 for v in tensorboard_scalars(tmp_path / "one" / "tb", "loss/train").values())
