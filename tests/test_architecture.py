"""The import structure holds: the layers contract in pyproject.toml ([tool.importlinter]) is kept,
and no two astrai modules import each other, directly or round a longer loop.

Both count imports written inside functions too (grimp reads every import statement of a
module), so a circle cannot hide behind a deferred import. Type-checking-only imports are left
out, as they never run. An astrai import inside a function is allowed only where
``DEFERRED_IMPORTS`` lists it with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_DOCS = ("README.md", "docs/architecture.md")
SOURCE_PATH = re.compile(r"(?<![\w/.~$])astrai/[\w/.]*\w")

# deferring buys nothing here: the package has loaded it already, or every call of the function needs it
# Every astrai import written inside a function, "file function -> module": why it waits for the call.
DEFERRED_IMPORTS = {
    "astrai/cli.py prepare_process -> astrai.parallel.setup":
        "torch: loaded once a compute verb runs, so `astrai --help` and a mistyped flag answer at once",
    "astrai/model/gguf.py _reader -> astrai.model.gguf_reader":
        "llama.cpp's gguf package (about 0.2 s): loaded when a GGUF file is first read, not with astrai.model",
    "astrai/tokenize/tokenizer.py AutoTokenizer.from_pretrained -> astrai.tokenize.gguf_vocab":
        "torch and the GGUF reader: loaded for a GGUF file's vocabulary only, not for a tokenizer.json",
    "astrai/model/calibration.py calibration_ids -> astrai.eval.perplexity":
        "the one upward import (pyproject's ignore_imports): eval's document reader, which belongs below both",
}


def import_circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative).
    An import of a package from inside it (its ``__init__`` run first) is no circle and is left out."""
    edges = {m: {t for t in graph.find_modules_directly_imported_by(m) if not m.startswith(t + ".")}
             for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circles():
    graph = grimp.build_graph("astrai", exclude_type_checking_imports=True, cache_dir=None)
    assert import_circles(graph) == []


def test_circle_finder_sees_loops_and_skips_package_faces():
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p", imported="p.d")
    graph.add_import(importer="p.d", imported="p")
    assert import_circles(graph) == [["p.a", "p.b", "p.c"]]


def in_function_imports(path: Path, package: str = "astrai") -> list[str]:
    """Each import of ``package`` written inside a function of the file at ``path``, as
    "file function -> module" (a method as Class.method, a nested function as outer.inner)."""
    found = []
    relative_to = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name], in_function or not isinstance(child, ast.ClassDef))
                continue
            if in_function and isinstance(child, ast.ImportFrom):
                modules = [child.module or ""] if child.level == 0 else [f"(relative) {child.module or ''}"]
            elif in_function and isinstance(child, ast.Import):
                modules = [alias.name for alias in child.names]
            else:
                modules = []
            for module in modules:
                if module.startswith("(relative)") or module == package or module.startswith(package + "."):
                    found.append(f"{relative_to} {'.'.join(scope)} -> {module}")
            visit(child, scope, in_function)

    visit(ast.parse(path.read_text(encoding="utf-8")), [], False)
    return found


def test_in_function_imports_are_the_listed_ones():
    """A new astrai import inside a function fails here until it is moved to its module's top
    or listed with a reason; a listed one that is gone fails until its entry goes too."""
    found = [entry for path in sorted((ROOT / "astrai").rglob("*.py")) for entry in in_function_imports(path)]
    unlisted = sorted(set(found) - set(DEFERRED_IMPORTS))
    gone = sorted(set(DEFERRED_IMPORTS) - set(found))
    assert not unlisted, f"astrai imports inside functions that DEFERRED_IMPORTS does not list: {unlisted}"
    assert not gone, f"DEFERRED_IMPORTS lists imports that are no longer there: {gone}"


def test_in_function_imports_are_found_in_methods_nested_functions_and_relative_form(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("from astrai.errors import DataError\n"
                      "import astrai.model\n"
                      "def load():\n"
                      "    import astrai.model.gguf, json\n"
                      "    def inner():\n"
                      "        from astrai import config\n"
                      "class Runner:\n"
                      "    from astrai.backends import backend_for\n"
                      "    def step(self):\n"
                      "        from .cache import KvcacheView\n"
                      "        from astraia import other\n")
    assert in_function_imports(source) == [
        "sample.py load -> astrai.model.gguf", "sample.py load.inner -> astrai",
        "sample.py Runner.step -> (relative) cache"]


def test_layers_contract_is_kept(capsys):
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert code == 0, report[-4000:]
    assert "0 broken" in report


def test_the_layout_the_docs_give_is_the_tree():
    """README's layout and docs/architecture.md name only files that exist, and the layout names
    every package, so a move that forgets the docs fails here."""
    for doc in LAYOUT_DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        missing = [path for path in SOURCE_PATH.findall(text) if not (ROOT / path).exists()]
        assert not missing, f"{doc} names {missing}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    named = {line.split()[0].split("/")[0] for line in layout.splitlines() if line.startswith("  ")}
    packages = {p.name for p in (ROOT / "astrai").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= named, f"README's layout leaves out {sorted(packages - named)}"
