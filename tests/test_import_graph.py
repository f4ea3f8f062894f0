"""The import plan of ``gpattn/``, read statically (every ``import`` and ``from ... import`` statement,
function-level ones included): no import cycle, and the core never imports the application
(``gpattn.experiments``), neither at ``import gpattn`` nor in any function."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpattn"
APP = "gpattn.experiments"
#: ``python -m gpattn`` is the application's command, not the core
ENTRY_POINTS = {"gpattn.__main__"}


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports. ``from a import b`` is an edge to ``a.b`` when ``b``
    is a module of the package, else to ``a``; relative imports are resolved; a module's parent packages
    (which Python runs first) are not edges, or every package importing its own submodules would be a cycle."""
    root = package.parent
    files = {_module_name(f, root): f for f in sorted(package.rglob("*.py"))}
    graph = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import gpattn.kernels.exponential.x` -> the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None (an iterative depth-first search)."""
    done, on_path = set(), []
    for start in sorted(graph):
        if start in done:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        on_path.append(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif child in on_path:
                return on_path[on_path.index(child) :] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                on_path.append(child)
    return None


def test_no_import_cycle_in_gpattn():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "import cycle in gpattn/: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """The check above can fail: a package whose modules import each other, one of them in a function."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n\ndef f():\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    return f\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("def g():\n    from pkg import a\n    return a\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_the_core_never_imports_the_application():
    """No module outside ``gpattn.experiments`` (but ``python -m gpattn``) imports it, even in a function."""
    graph = import_graph(PACKAGE)
    reaching = {
        f"{module} -> {target}"
        for module, targets in graph.items()
        if not (module == APP or module.startswith(APP + ".")) and module not in ENTRY_POINTS
        for target in targets
        if target == APP or target.startswith(APP + ".")
    }
    assert not reaching, f"the core imports the application: {sorted(reaching)}"


def test_import_gpattn_does_not_import_the_application():
    code = "import gpattn, sys; assert not any(m.startswith('gpattn.experiments') for m in sys.modules), sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
