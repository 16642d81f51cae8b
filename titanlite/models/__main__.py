"""python -m titanlite.models: a table of every registered family and flavor.

Models are built on the meta device, so even 405B costs no memory and takes a moment.
"""

from dataclasses import replace

import torch

from titanlite.models import list_model_specs

_COLUMNS = ("family", "flavor", "params", "layers", "dim", "heads", "kv heads", "vocab")


def _count_params(spec, args) -> int:
    with torch.device("meta"):
        return spec.model_cls(args).num_params()


def _params_text(spec, args) -> str:
    if args.vocab_size > 0:
        return f"{_count_params(spec, args):,}"
    # The vocab comes from the tokenizer: show the fixed part plus the cost of each vocab entry
    # (measured from vocabs of 1 and 2, as an empty one makes torch warn).
    one, two = (_count_params(spec, replace(args, vocab_size=v)) for v in (1, 2))
    per_entry = two - one
    fixed = one - per_entry
    return f"{fixed:,} + {per_entry:,} x vocab"


def _rows() -> list[tuple[str, ...]]:
    return [
        (spec.name, flavor, _params_text(spec, args), str(args.n_layers), str(args.dim),
         str(args.n_heads), str(args.n_kv_heads), f"{args.vocab_size:,}" if args.vocab_size > 0 else "tokenizer")
        for spec in list_model_specs()
        for flavor, args in spec.flavors.items()
    ]


def main() -> None:
    table = [_COLUMNS, *_rows()]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    for row in table:
        # Text columns left-aligned, numbers right-aligned.
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    main()
