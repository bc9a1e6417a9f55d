"""The house's import rules (docs/layout.md), read from the source: data flows one way (kernels
imports nothing of fastformer, bench nothing of tools), the train wing's modules import one way
(no cycle, even through an import inside a function), and the GPU check's modules use nothing
private of one another."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(path):
    """(module, names) of every import in a file, at any depth: `from a.b import c` gives
    ("a.b", ["c"]), `import a.b` gives ("a.b", [])."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
    return found


def module_name(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_kernels_import_nothing_of_fastformer_and_bench_nothing_of_tools():
    for path in (ROOT / "kernels").glob("*.py"):
        assert not [m for m, _ in imports(path) if m.split(".")[0] == "fastformer"], path
    for path in (ROOT / "bench").glob("*.py"):
        assert not [m for m, _ in imports(path) if m.split(".")[0] == "tools"], path


def test_the_train_wing_imports_one_way():
    """fastformer/train's modules, with the imports inside functions counted: a graph without a
    cycle (rundir imports nothing of run, whose checks it uses from checks)."""
    modules = {module_name(p): p for p in (ROOT / "fastformer" / "train").glob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for module, names in imports(path):
            targets |= {module} | {f"{module}.{n}" for n in names}
        edges[name] = {t for t in targets if t in modules and t != name}
    assert "fastformer.train.run" not in edges["fastformer.train.rundir"]

    def visit(name, stack):
        assert name not in stack, f"an import cycle: {' -> '.join([*stack, name])}"
        for target in edges[name]:
            visit(target, [*stack, name])

    for name in modules:
        visit(name, [])


def test_the_gpu_checks_modules_use_nothing_private_of_one_another():
    for path in (ROOT / "tools" / "gpu_check").glob("*.py"):
        for module, names in imports(path):
            if module.startswith("tools."):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{path.name} imports {private} from {module}"
