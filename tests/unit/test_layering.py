"""The layering holds: no import cycle among the project's modules, no branching on a source's kind
outside the registry, and every module imports cold."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "training")


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = path
    return mods


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules a file imports anywhere (function-level too; ``if TYPE_CHECKING`` blocks excepted)."""
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_project_modules():
    mods = project_modules()
    graph = {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}
    assert cycles(graph) == []
    # the schema layer imports nothing of the runtime
    runtime = {m for m in mods if m.startswith(("pipeline.generate", "pipeline.hidden", "pipeline.run.",
                                                "pipeline.report"))}
    assert not (graph["pipeline.base.config"] & runtime)
    assert graph["pipeline.generate.router"] <= {"pipeline.base.config", "pipeline.generate.sources.registry"}


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_branching_on_source_kind_outside_the_registry():
    """No comparison of anything with a source kind's name ("vllm", "openrouter", ...) outside the registry."""
    from pipeline.generate.sources.registry import SOURCES

    def names_a_kind(node: ast.AST) -> bool:
        return any(isinstance(c, ast.Constant) and c.value in SOURCES for c in ast.walk(node))

    def is_kind(node: ast.AST) -> bool:
        probe = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                 and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "kind")
        return probe or (isinstance(node, ast.Attribute) and node.attr == "kind") or (isinstance(node, ast.Name)
                                                                                      and node.id == "kind")

    offenders = []
    for name, path in project_modules().items():
        if name == "pipeline.generate.sources.registry":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if any(map(is_kind, operands)) and any(map(names_a_kind, operands)):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_no_branching_on_the_hand_off_mode_outside_its_classes():
    """What differs between ``extraction.mode: stream`` and ``shards`` is a ``Handoff`` subclass's answer
    (pipeline.hidden.handoff.HANDOFFS); only the config's own checks name a mode."""
    from pipeline.hidden.handoff import HANDOFFS

    allowed = {"pipeline.hidden.handoff", "pipeline.base.config", "pipeline.run.config"}
    offenders = []
    for name, path in project_modules().items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if any(isinstance(o, ast.Attribute) and o.attr == "mode" for o in operands) and any(
                    isinstance(o, ast.Constant) and o.value in HANDOFFS for o in operands):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_no_branching_on_the_extraction_backend_outside_its_table():
    """What differs between extraction backends is an ``EXTRACTION_BACKENDS`` entry's answer (pipeline.base.config:
    ``holds_engine``, ``gpus``, the capture it builds); the config's schema lists the same names."""
    import typing

    from pipeline.base.config import EXTRACTION_BACKENDS, ExtractionConfig

    assert set(typing.get_args(ExtractionConfig.model_fields["backend"].annotation)) == set(EXTRACTION_BACKENDS)
    for b in EXTRACTION_BACKENDS.values():
        assert callable(b.build_capture())
    offenders = []
    for name, path in project_modules().items():
        if name == "pipeline.base.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if any((isinstance(o, ast.Attribute) and o.attr == "backend") or (isinstance(o, ast.Name) and o.id ==
                   "backend") for o in operands) and any(isinstance(o, ast.Constant) and o.value in EXTRACTION_BACKENDS
                                                        for o in operands):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_each_source_kind_is_self_contained_and_the_config_union_comes_from_the_registry():
    """A kind's schema sits beside its adapter (the same package) and every schema of the ``sources:`` union is
    a registry entry's, so a new kind is one module and one line in ``KIND_MODULES``."""
    import typing

    from pipeline.base.config import SourceConfigBase
    from pipeline.generate.sources.registry import SOURCES, SourceConfig
    from pipeline.run.config import RunConfig

    union = typing.get_args(typing.get_args(SourceConfig)[0])
    assert set(union) == {k.config for k in SOURCES.values()} and len(union) == len(SOURCES)
    assert typing.get_args(RunConfig.model_fields["sources"].annotation)[0] is SourceConfig
    for name, kind in SOURCES.items():
        assert issubclass(kind.config, SourceConfigBase)
        assert kind.config.model_fields["kind"].default == name
        schema_pkg = kind.config.__module__.rsplit(".", 1)[0]
        assert kind.actor.split(":")[0].rsplit(".", 1)[0] == schema_pkg, f"{name}: schema away from its adapter"


def test_no_field_of_one_kinds_schema_is_probed_outside_it():
    """``getattr(src, "budgets", None)`` asks a source what only one kind has: the answer belongs in a method of
    ``SourceConfigBase`` that each kind overrides (``describe``, ``actor_resources``, ``tools_sent``, ...)."""
    from pipeline.base.config import SourceConfigBase
    from pipeline.generate.sources.registry import SOURCES

    own = {f for k in SOURCES.values() for f in k.config.model_fields} - set(SourceConfigBase.model_fields)
    schemas = {k.config.__module__ for k in SOURCES.values()}
    offenders = []
    for name, path in project_modules().items():
        if name in schemas:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                  "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in ("src", "s", "source", "cfg")
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in own):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_every_module_imports_cold():
    """Each module in a fresh interpreter of its own would be slow; one interpreter importing them in
    sorted order catches import-time errors, and the acyclic graph above makes the order irrelevant."""
    names = sorted(project_modules())
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    res = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


# The floors of pipeline/, in the order data flows; each imports only the floors it names (imports inside
# functions count; ``if TYPE_CHECKING`` blocks do not). run/ is the top: the job, the CLI, status.
FLOORS: dict[str, set[str]] = {
    "profiles": set(),                                       # chat formats and tokenizers: pure
    "base": {"profiles"},                                    # config, records, layout, logs, console, run lock
    "prompts": {"base", "profiles"},                         # dataset files in
    "checks": {"base", "profiles"},                          # reconstruction, validation, audit
    "report": {"checks", "base", "profiles"},                # tally, report, costs, report.html
    "generate": {"checks", "base", "profiles"},              # stages, routing, budgets, sources
    "hidden": {"generate", "report", "checks", "base", "profiles"},  # extraction, hand-off to training
    "demo": {"base", "profiles"},                            # tiny targets, the stand-in server
    "value": {"hidden", "generate", "report", "checks", "base", "profiles"},  # value drafters, curves, plan
    "run": {"value", "hidden", "generate", "report", "checks", "prompts", "base", "profiles", "demo"},
}
# training/ reads the run folder's paths (base) and captures hidden states with the extraction's loader.
TRAINING_MAY_IMPORT = {"base", "hidden", "profiles"}


def floor_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeline" and len(parts) > 1 and parts[1] in FLOORS else None


def test_every_pipeline_module_sits_on_a_floor():
    loose = [m for m in project_modules() if m.startswith("pipeline.") and floor_of(m) is None]
    assert loose == ["pipeline.__main__"]  # `python -m pipeline`: the CLI's entry point, above every floor


def test_each_floor_imports_only_the_floors_below_it():
    mods = project_modules()
    offenders = []
    for name, path in mods.items():
        here = floor_of(name) if name.startswith("pipeline.") else "training"
        if here is None:
            continue
        allowed = TRAINING_MAY_IMPORT if here == "training" else FLOORS[here] | {here}
        for dep in imports_of(path, set(mods)):
            there = floor_of(dep)
            if dep.startswith("pipeline.") and there not in allowed:
                offenders.append(f"{name} ({here}) imports {dep} ({there})")
    assert offenders == []


def test_the_floor_check_catches_an_upward_import(tmp_path):
    """generate/ importing hidden/ (inside a function, as lazy imports are) is caught."""
    f = tmp_path / "mod.py"
    f.write_text("def g():\n    from pipeline.hidden.extract import capture\n")
    deps = imports_of(f, {"pipeline.hidden.extract", "pipeline.generate.stages"})
    assert deps == {"pipeline.hidden.extract"} and floor_of("pipeline.hidden.extract") not in FLOORS["generate"]
