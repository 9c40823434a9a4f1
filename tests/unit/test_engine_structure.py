"""The engine's shape, checked from its source: no import circle (deferred imports count) and no
upward import inside `engine/`, the executor above the engine, and no policy named outside the
policy registry (a policy's behaviour is its registry entry's, never a string test elsewhere in the
engine or the server)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.decoding.registry import POLICY_NAMES

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
# The step's modules, lowest first: each may import only those before it (and the packages below).
STEP = ("request", "summary", "batch", "slots", "uniform_slots", "decide", "mode", "masked_mode", "block_mode",
        "uniform_mode", "model_runner", "advance", "scheduler", "engine")
# Packages below the step: they import nothing of it.
LOWER = ("engine.decoding", "engine.models", "engine.loading")
# Above the engine: what starts and drives engines (the tensor-parallel group); nothing below imports it.
ABOVE = "engine.executor"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every engine module `path` imports, at any depth of its code (TYPE_CHECKING blocks too)."""
    modules = {_module(p) for p in ENGINE.rglob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("engine"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            for alias in node.names:  # `from package import module` imports the module
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
    return {name for name in found if name in modules} - {_module(path)}


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in ENGINE.rglob("*.py") if p.name != "__init__.py" or p.parent != ENGINE}


def test_no_import_circle_in_the_engine():
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import circle: {' -> '.join([*path[path.index(module):], module])}"
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_no_upward_import_in_the_engine():
    graph = _graph()
    step = [f"engine.{name}" for name in STEP]
    for module, imported in graph.items():
        if module.startswith(LOWER):
            assert not imported & set(step), f"{module} imports the step: {sorted(imported & set(step))}"
        if module in step:
            above = set(step[step.index(module):])
            assert not imported & above, f"{module} imports {sorted(imported & above)}, above it"


def test_the_executor_is_above_the_engine():
    below = {module: sorted(i for i in imported if i.startswith(ABOVE))
             for module, imported in _graph().items() if not module.startswith(ABOVE)}
    found = {module: imported for module, imported in below.items() if imported}
    assert not found, f"imports of {ABOVE} from below it: {found}"


def test_the_one_device_engine_refuses_a_group_and_names_the_factory():
    """A group is started above the engine: `Engine(config)` is one device's, whatever the config
    says (refused before anything loads)."""
    from engine import Engine, EngineConfig
    from engine.errors import SettingError

    with pytest.raises(SettingError, match="start_engine"):
        Engine(EngineConfig(model="any", tensor_parallel_size=2))


def _policy_word(node: ast.AST) -> bool:
    """A string constant that names a policy or a family of them ("dream-"), or a collection of such."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_policy_word(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value in POLICY_NAMES or any(name.startswith(node.value) and node.value.endswith("-")
                                          for name in POLICY_NAMES))


def test_no_policy_is_named_outside_the_registry():
    """No comparison with a policy's name (==, in, startswith) in the engine or the server, but in
    the registry; a knob's declaration may say which policies read it."""
    found = []
    for path in sorted([*ENGINE.rglob("*.py"), *(ROOT / "server").rglob("*.py")]):
        if path == ENGINE / "decoding" / "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            compared = []
            if isinstance(node, ast.Compare):
                compared = [node.left, *node.comparators]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "startswith", "endswith"):
                compared = list(node.args)
            if any(_policy_word(n) for n in compared):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"a policy's name is tested outside engine/decoding/registry.py: {found}"


# A request's host state is written where a row advances and where its prefix is restored, nowhere else.
REQUEST_WRITERS = {"engine.request", "engine.advance", "engine.prefix_cache"}
MAX_REQUEST_ATTRIBUTES = 20
_ROW_NAMES = {"request", "r", "row", "req"}  # what the engine calls a Request (or a registry Row)


def _written_row(target: ast.AST) -> bool:
    """An assignment to an attribute of a row (`request.step = ...`, `request.stats.nfe += ...`,
    `request.mirror.tokens[...] = ...`)."""
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        target = target.value
        if isinstance(target, ast.Name) and target.id in _ROW_NAMES:
            return True
    return False


def test_a_request_is_small_and_written_by_few_modules():
    tree = ast.parse((ENGINE / "request.py").read_text())
    request = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Request")
    attributes = {t.attr for n in ast.walk(request) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert len(attributes) <= MAX_REQUEST_ATTRIBUTES, sorted(attributes)
    writers = set()
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            if any(_written_row(t) for t in targets):
                writers.add(_module(path))
    outside = sorted(writers - REQUEST_WRITERS)
    assert not outside, f"a Request written outside {sorted(REQUEST_WRITERS)}: {outside}"
