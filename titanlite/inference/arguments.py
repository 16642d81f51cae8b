"""The Python API's arguments checked before torch sees them: each wrong type or value is one sentence naming the
argument and what to give instead (a UserError), never an error from deep inside torch.

Token ids may come as lists of ints, or as integer tensors or numpy arrays (a 1-D one is one prompt or one
sequence, a 2-D one a batch): they are taken as the lists they hold. `stop` may be one string, as transformers'
stop_strings takes it, or a list of strings.
"""

import math
import numbers

from titanlite.errors import UserError
from titanlite.inference.sampling import Sampling

PROMPT_KINDS = "each a string, a list of messages or a list of token ids"


def is_whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_array(value) -> bool:
    """A torch tensor or a numpy array (told by its attributes: numpy is not imported for this)."""
    return all(hasattr(value, name) for name in ("tolist", "ndim", "dtype", "shape"))


def array_ids(value, where: str, ndims: tuple[int, ...]) -> list:
    """An integer tensor or array of `ndims` dimensions as the list(s) of ints it holds."""
    kind = str(value.dtype)
    if value.ndim not in ndims or "int" not in kind:
        shape = "x".join(map(str, value.shape)) or "0-dim"
        raise UserError(
            f"{where} is a {shape} array of {kind.removeprefix('torch.')}; token ids are whole numbers, "
            f"{' or '.join(f'{n}-D' for n in ndims)}: give a list of ints or an integer array"
        )
    return value.tolist()


def checked_prompts(prompts) -> list:
    """generate's prompts as a list, each a str, a list of messages, or a list of ints (arrays converted)."""
    if is_array(prompts):
        prompts = array_ids(prompts, "prompts", (2,))
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, (list, tuple)):
        raise UserError(
            f"generate takes a list of prompts ({PROMPT_KINDS}), not a {type(prompts).__name__}; wrap a "
            "single prompt in a list"
        )
    if not prompts:
        raise UserError("generate got an empty list of prompts; give at least one prompt")
    if any(isinstance(p, (dict, numbers.Number)) for p in prompts):
        raise UserError(f"generate takes a list of prompts ({PROMPT_KINDS}); wrap a single prompt in a list")
    checked = []
    for number, prompt in enumerate(prompts):
        if is_array(prompt):
            prompt = array_ids(prompt, f"prompts[{number}]", (1,))
        elif not isinstance(prompt, (str, list, tuple)):
            raise UserError(f"prompts[{number}] is a {type(prompt).__name__}; give a prompt as {PROMPT_KINDS}")
        checked.append(list(prompt) if isinstance(prompt, tuple) else prompt)
    return checked


def checked_stop(stop) -> tuple[str, ...]:
    """None, one string or a list of non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise UserError(f"stop={stop!r}: give a string, or a list of strings that each end a completion")
    if "" in stops:
        raise UserError(
            "stop holds an empty string, which would end every completion before its first token; remove it"
        )
    return tuple(stops)


def check_number(name: str, value, whole: bool, low: float, high: float, advice: str) -> None:
    """`value` is a finite (whole) number from low to high, both included; else one sentence with `advice`."""
    kind = is_whole(value) if whole else isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not kind or not math.isfinite(value) or not low <= value <= high:
        raise UserError(f"{name}={value!r}: {advice}")


def checked_sampling(max_new_tokens, temperature, top_p, top_k, seed, stop, *, min_new_tokens, ignore_eos) -> Sampling:
    """generate's sampling arguments, each checked (the [generate] section checks the same ones)."""
    check_number("max_new_tokens", max_new_tokens, True, 1, math.inf, "give a whole number of at least 1")
    check_number("temperature", temperature, False, 0, math.inf, "give 0 (greedy) or more")
    check_number("top_p", top_p, False, math.ulp(0), 1, "give a number above 0 and at most 1 (1 = every token)")
    check_number("top_k", top_k, True, 0, math.inf, "give 0 (every token) or a larger whole number")
    check_number("seed", seed, True, 0, 2**32 - 1, "give a whole number from 0 to 2**32 - 1")
    check_number(
        "min_new_tokens",
        min_new_tokens,
        True,
        0,
        max_new_tokens,
        f"give a whole number from 0 to max_new_tokens ({max_new_tokens})",
    )
    if not isinstance(ignore_eos, bool):
        raise UserError(f"ignore_eos={ignore_eos!r}: give True (the stop tokens end nothing) or False")
    return Sampling(
        int(max_new_tokens),
        float(temperature),
        float(top_p),
        int(top_k),
        int(seed),
        checked_stop(stop),
        min_new_tokens=int(min_new_tokens),
        ignore_eos=ignore_eos,
    )


def check_batch_size(batch_size) -> None:
    if batch_size is not None:
        check_number(
            "batch_size", batch_size, True, 1, math.inf, "give a whole number of at least 1, or None for one batch"
        )


def checked_logits_ids(token_ids) -> list:
    """logits' input as a list of ints [T] or a list of equally long lists of ints [B, T]."""
    ids = array_ids(token_ids, "token_ids", (1, 2)) if is_array(token_ids) else token_ids
    advice = "give a non-empty list of token ids, a list of equally long lists of them, or an integer array"
    if not isinstance(ids, (list, tuple)) or not ids:
        raise UserError(f"logits got {type(token_ids).__name__} {str(token_ids)[:40]}; {advice}")
    if all(is_whole(i) for i in ids):
        return list(ids)
    rows = [row for row in ids if isinstance(row, (list, tuple)) and row and all(is_whole(i) for i in row)]
    if len(rows) != len(ids) or len({len(row) for row in rows}) != 1:
        raise UserError(f"logits got token ids that are not one list of ints nor equally long lists of ints; {advice}")
    return [list(row) for row in rows]
