"""The layering the code promises (DESIGN.md, README "Where things live"): no import cycle in the package,
the planner never imports the trainer's entry point, parallel/ does not reach up into models/, and no
file outgrows what one reading can hold."""

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


def test_importing_the_planner_does_not_import_the_trainer():
    code = "import sys, titanlite.plan.job, titanlite.plan.__main__; print('titanlite.train' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_starting_a_run_imports_no_library_that_only_some_runs_use():
    """`datasets` (with pyarrow and pandas) and torch.distributed.pipelining took 1.5 of a debug run's 6.3 s of
    start-up on the 2-core CI machine while the shipped sample and most runs use neither: each is imported
    where a run needs it (local_files.py, documents.py, datasets.py; parallel/pp.py)."""
    code = ("import sys, titanlite.train; "
            "print(sorted(m for m in ('datasets', 'pyarrow', 'torch.distributed.pipelining') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_parallel_does_not_import_models():
    graph = import_graph()
    upward = {(name, target) for name, targets in graph.items() if name.startswith("titanlite.parallel")
              for target in targets if target.startswith("titanlite.models")}
    assert upward == set()


def test_no_file_outgrows_one_reading():
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert lengths["titanlite/train.py"] <= 300
    assert {name: n for name, n in lengths.items() if n > 400} == {}


def test_the_readme_layout_names_every_folder_and_top_level_module():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    listed = {line.split()[0] for line in layout.splitlines() if line.strip()}
    ours = {f"titanlite/{p.name}" + ("/" if p.is_dir() else "") for p in PACKAGE.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")}
    assert ours - listed == set()
