"""Run under torchrun by test_float8_tp.py: tp_families' 5 steps (the trainer's build_model and
train_step, documents with the block-causal mask) of each family in emulated float8 under TP (the
whole world) and unsharded on every rank, for each recipe; and the unsharded run without float8,
to show float8 changed the numbers. Rank 0 writes {recipe: {family: [[tp, one process, no float8], ...]}}
as JSON to argv[1]; argv[2] lists the families (comma-separated), argv[3] the recipes."""

import sys

from tp_families import losses, write_from_rank0


def main(out_path: str, families: str = "llama3", recipes: str = "tensorwise,rowwise") -> None:
    def results(world: int) -> dict:
        by_recipe = {}
        for recipe in recipes.split(","):
            float8 = ("--float8.enable", "--float8.emulate", "--float8.recipe_name", recipe)
            by_recipe[recipe] = {
                name: list(zip(losses(name, world, float8), losses(name, 1, float8), losses(name, 1)))
                for name in families.split(",")
            }
        return by_recipe

    write_from_rank0(out_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:])
