"""python -m titanlite.models: a table of every registered family and flavor.

Models are built on the meta device, so even 405B costs no memory and takes a moment.
"""

from dataclasses import replace

import torch

from titanlite.models import list_model_specs

_COLUMNS = ("family", "flavor", "params", "active", "layers", "dim", "heads", "kv heads", "vocab")


def _count_params(spec, args, active: bool = False) -> int:
    """All parameters, or with `active` those one token uses (the MoE families' top-k experts)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
        return model.num_params(active=True) if active else model.num_params()


def _params_text(spec, args, active: bool = False) -> str:
    if active and not hasattr(args, "num_experts"):
        return "-"  # dense: every parameter is active
    if args.vocab_size > 0:
        return f"{_count_params(spec, args, active):,}"
    # The vocab comes from the tokenizer: show the fixed part plus the cost of each vocab entry
    # (measured from vocabs of 1 and 2, as an empty one makes torch warn).
    one, two = (_count_params(spec, replace(args, vocab_size=v), active) for v in (1, 2))
    per_entry = two - one
    fixed = one - per_entry
    return f"{fixed:,} + {per_entry:,} x vocab"


def _rows() -> list[tuple[str, ...]]:
    return [
        (
            spec.name,
            flavor,
            _params_text(spec, args),
            _params_text(spec, args, active=True),
            str(args.n_layers),
            str(args.dim),
            str(args.n_heads),
            str(args.n_kv_heads),
            f"{args.vocab_size:,}" if args.vocab_size > 0 else "tokenizer",
        )
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
