"""The layering the code promises (docs/design.md, README "Layout"): no import cycle in the package,
the planner never imports the trainer's entry point, no library module imports an entry point, a training run
does not import lm-eval, parallel/ does not reach up into models/, and no file outgrows what one reading can hold."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "titanlite"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import name` imports pkg, and pkg.name where that is a module
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(files)) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_is_read_from_the_code():
    graph = import_graph()
    assert "titanlite.build" in graph["titanlite.train"]
    assert "titanlite.loss" in graph["titanlite.plan.activations"]


def test_no_module_of_the_package_is_part_of_an_import_cycle():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found_where_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def room(module: str) -> str:
    """A module's room: its folder of the package (titanlite.checkpoint.manager -> checkpoint), or the
    top-level module itself (titanlite.loss -> loss)."""
    return module.split(".")[1] if module.count(".") else module


def test_no_folder_or_top_level_module_is_part_of_a_cycle():
    """Module cycles are refused above; here the rooms too: models -> parallel -> lora -> models once ran
    through three folders without any module importing itself."""
    rooms = {}
    for name, targets in import_graph().items():
        rooms.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    assert cycles({name: targets & set(rooms) for name, targets in rooms.items()}) == []


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def positional_or_required(node: ast.FunctionDef) -> int:
    """Parameters a caller must line up: positional ones (self and cls aside) and keyword-only ones without a
    default."""
    positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    return len(positional) + sum(default is None for default in node.args.kw_defaults)


def test_no_function_is_long_or_takes_a_dozen_parameters():
    """State travels in build.py's Run and the sections of the config, not threaded by hand: no function is over
    80 lines, none takes more than 8 positional or required parameters (keyword options with defaults are free)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in functions(path):
            lines, params = node.end_lineno - node.lineno + 1, positional_or_required(node)
            if lines > 80 or params > 8:
                found[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = (lines, params)
    assert found == {}


def test_an_observer_runs_no_collective():
    """An observer that fails turns itself off on its own rank: a collective inside it would leave the other ranks
    waiting (titanlite/metrics/observers.py). Collectives run outside, on every rank alike."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in functions(path):
            observed = any(
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "observer" for d in node.decorator_list
            )
            calls = {
                c.func.attr
                for c in ast.walk(node)
                if isinstance(c, ast.Call)
                and isinstance(c.func, ast.Attribute)
                and getattr(c.func.value, "id", "") == "dist"
            }
            if observed and calls:
                found.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} {node.name} calls dist.{', dist.'.join(sorted(calls))}"
                )
    assert found == []


def test_importing_the_planner_does_not_import_the_trainer():
    code = "import sys, titanlite.plan.job, titanlite.plan.__main__; print('titanlite.train' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_starting_a_run_imports_no_library_that_only_some_runs_use():
    """`datasets` (with pyarrow and pandas) and torch.distributed.pipelining took 1.5 of a debug run's 6.3 s of
    start-up on the 2-core CI machine while the shipped sample and most runs use neither: each is imported
    where a run needs it (local_files.py, documents.py, datasets.py; parallel/pp.py)."""
    code = (
        "import sys, titanlite.train; "
        "print(sorted(m for m in ('datasets', 'pyarrow', 'torch.distributed.pipelining') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_training_run_does_not_import_lm_eval():
    """lm-eval (with its datasets, evaluate and sacrebleu imports) is imported only where evaluation runs: by
    python -m titanlite.eval, or by the in-loop evaluator of a run whose [eval] evaluates."""
    code = "import sys, titanlite.train; print('lm_eval' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


ENTRY_POINTS = {
    "titanlite.train",
    "titanlite.generate",
    "titanlite.eval",
    "titanlite.convert",
    "titanlite.plan.__main__",
    "titanlite.models.__main__",
    "titanlite.data.prepare",
}


def test_every_entry_point_named_is_run_as_a_program():
    run = {module_name(path) for path in PACKAGE.rglob("*.py") if '__name__ == "__main__"' in path.read_text()}
    assert ENTRY_POINTS - run - {"titanlite.plan.__main__", "titanlite.models.__main__"} == set()


def test_no_library_module_imports_an_entry_point():
    """An entry point parses arguments, opens and closes the process group and exits; the library it calls never
    imports it back (eval_loop.py once imported generate.py for its prompt reader)."""
    graph = import_graph()
    assert {
        (name, target)
        for name, targets in graph.items()
        if name not in ENTRY_POINTS
        for target in targets & ENTRY_POINTS
    } == set()


def test_parallel_does_not_import_models():
    graph = import_graph()
    upward = {
        (name, target)
        for name, targets in graph.items()
        if name.startswith("titanlite.parallel")
        for target in targets
        if target.startswith("titanlite.models")
    }
    assert upward == set()


def test_no_file_outgrows_one_reading():
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert lengths["titanlite/train.py"] <= 300
    assert {name: n for name, n in lengths.items() if n > 400} == {}


def test_the_readme_layout_names_every_folder_and_top_level_module():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    listed = {line.split()[0] for line in layout.splitlines() if line.strip()}
    ours = {
        f"titanlite/{p.name}" + ("/" if p.is_dir() else "")
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert ours - listed == set()


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {name for name in pages if f"(docs/{name}" not in readme} == set()


def test_only_the_objectives_builder_compares_the_data_format():
    """The objective is chosen once (titanlite/objectives/__init__.py); the step, the build, the planner and the
    checkpoint ask it. Outside data/ and the config, no other module compares training.dataset_format."""
    allowed = {
        "titanlite/objectives/__init__.py",
        "titanlite/config.py",
    }
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(ROOT).as_posix()
        if name in allowed or name.startswith(
            ("titanlite/data/", "titanlite/config_rules/", "titanlite/config_sections/")
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Attribute) and side.attr == "dataset_format"
                for side in [node.left, *node.comparators]
            ):
                found.append(f"{name}:{node.lineno}")
    assert found == []


def test_at_most_sixteen_modules_sit_flat_in_the_package():
    """Entry points and the few modules every room uses sit in titanlite/; the rest live in packages named for
    their room (docs/design.md)."""
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= 16, flat
