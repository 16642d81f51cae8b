"""Real tools and environments for the agent tests (rl.tools, rl.environment), and a tiny model whose sampled output is
known: a Llama whose blocks add nothing (their output projections are zero), so each next token is a function of the
current one alone. After the generation prompt's last token it writes CALL (one added token holding a whole
`<tool_call>` of add(2, 3)), then <|im_end|>: every turn of every episode calls add, whatever the seed."""

import json
import threading
import time
from pathlib import Path

import torch

CALL = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
NOT_A_TOOL = 3


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def sleepy(a: int, b: int) -> int:
    """Adds two integers, slowly.

    Args:
        a: the first
        b: the second
    """
    time.sleep(30)
    return a + b


def broken(a: int, b: int) -> int:
    """Fails.

    Args:
        a: the first
        b: the second
    """
    raise ValueError("no sums today")


def long_answer(a: int, b: int) -> str:
    """A long result.

    Args:
        a: the first
        b: the second
    """
    return "digits " * 400


def untyped(a, b):
    """Adds.

    Args:
        a: the first
        b: the second
    """
    return a + b


def undocumented(a: int, b: int) -> int:
    return a + b


class Calculator:
    """An environment whose add tool counts its calls; its reward is the number of calls, and reset() tells the model
    the answer it should reach."""

    def __init__(self):
        self.calls = 0

    def reset(self, prompt=None, answer=None, **fields) -> str:
        self.calls = 0
        return f" (the answer is {answer})"

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: the first
            b: the second
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


class Unpicklable(Calculator):
    """A Calculator holding a lock, which pickle refuses (rl.max_staleness saves environments)."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


class NoReset:
    def add(self, a: int, b: int) -> int:
        """Adds.

        Args:
            a: the first
            b: the second
        """
        return a + b


def tokenizer_folder(folder: Path, template: str) -> Path:
    """The chat example's tokenizer with `template` and CALL as one added token."""
    from tokenizers import AddedToken, Tokenizer

    from titanlite.examples.chat_example import write_tokenizer_folder

    write_tokenizer_folder(folder, chat_template=template)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(CALL, special=False, normalized=False)])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def calling_model(
    folder: Path, template: str, scale: float = 10.0, prompt_end: str = "<|im_start|>assistant\n"
) -> Path:
    """An HF folder of the model described above, its tokenizer beside it (the template as its chat template). With a
    smaller `scale` it calls less surely: at 1.2 it writes CALL after the prompt in about 60% of the samples, some
    random token otherwise (and goes on at random)."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer_folder(folder, template)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    last = tokenizer.encode(prompt_end, add_special_tokens=False).ids[-1]
    call, end = tokenizer.token_to_id(CALL), tokenizer.token_to_id("<|im_end|>")
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[last, 0], embed[call, 1] = 1.0, 1.0
        head[call, 0], head[end, 1] = scale, scale  # logits 10 sqrt(32): every other token's probability below 1e-20
    model.save_pretrained(folder)
    return folder


def prompts_file(path: Path, count: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 3?"}], "answer": str(i + 3)}) + "\n"
            for i in range(count)
        )
    )
    return path
