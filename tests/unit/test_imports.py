"""The import rules of docs/ARCHITECTURE.md ("Floors"), read from the sources with ast: every import of the project's
own modules counts, at module level, inside a function (often an import moved there to hide a circle) and under
TYPE_CHECKING alike.

- no circle among the project's modules;
- each module imports only from its own floor or below: top (the daemon, the composition root, and what serves it)
  > capabilities > services > shared > bottom (which imports nothing of the project);
- a capability imports another capability only through its typed part (`<capability>/model.py`), and
  `qosagent/config.py` each package's schema (`<package>/config.py`), which sits on the shared floor;
- only the daemon's own endpoints (the CLI, the status socket, /metrics, /readyz) import the daemon, and only the
  daemon, the CLI and status the list of capabilities;
- the project's own modules are imported inside a function only by the CLI (each command loads what it runs):
  elsewhere such an import hides a circle or a floor. Heavy third-party modules (bcc, pyroute2, grpc, pynvml) stay
  imported where they are used, which these rules do not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qosagent"

TOP = {"qosagent.__main__", "qosagent.cli", "qosagent.daemon", "qosagent.capabilities", "qosagent.status",
       "qosagent.metrics", "qosagent.readiness"}
SERVICES = {"netns", "pods"}
BOTTOM = {"hostfs", "snapshot", "hist", "schedule", "statefile", "units", "cpulist", "window", "syscall"}
FLOORS = ("bottom", "shared", "services", "capabilities", "top")
DAEMON_USERS = {"qosagent.cli", "qosagent.status", "qosagent.metrics", "qosagent.readiness"}
LIST_USERS = {"qosagent.daemon", "qosagent.cli", "qosagent.status"}

# Known offenders, each with why it is here and who moves it; the list only shrinks (an entry no longer found fails
# the test, so it is taken out as the move lands) and must end empty.
ALLOWED: dict[tuple[str, str], str] = {
}
# Circles, by their members, with the same rule.
ALLOWED_CIRCLES: dict[frozenset[str], str] = {
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module of the project it imports: line}, wherever in the file the import is."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                raise AssertionError(f"{path}:{node.lineno}: a relative import; the rules read absolute ones")
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t not in (name, "qosagent"):
                    found.setdefault(t, node.lineno)
        graph[name] = found
    return graph


def lazy_imports(mods: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(module, line, imported) for each import of the project's modules inside a function."""
    out = []
    for name, path in mods.items():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("qosagent"):
                    out.append((name, node.lineno, node.module or ""))
                elif isinstance(node, ast.Import):
                    out += [(name, node.lineno, a.name) for a in node.names if a.name.startswith("qosagent")]
    return sorted(set(out))


def capability_packages(package: Path = PACKAGE) -> set[str]:
    return {p.parent.name for p in package.glob("*/capability.py")}


def floor(module: str, caps: set[str]) -> int:
    if module in TOP:
        return FLOORS.index("top")
    parts = module.split(".")
    if len(parts) == 1:
        return FLOORS.index("bottom")  # qosagent/__init__.py: the version, nothing imported
    if len(parts) == 3 and parts[2] == "config":
        return FLOORS.index("shared")  # a schema: config.py composes it, everything may read it
    head = parts[1]
    if head in caps:
        return FLOORS.index("capabilities")
    if head in SERVICES:
        return FLOORS.index("services")
    if head in BOTTOM:
        return FLOORS.index("bottom")
    return FLOORS.index("shared")


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                members = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    members.add(w)
                    if w == v:
                        break
                if len(members) > 1:
                    out.append(frozenset(members))
    return out


def offences(graph: dict[str, dict[str, int]], caps: set[str]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> the rule it breaks."""
    out = {}
    for m, targets in graph.items():
        for t in targets:
            fm, ft = floor(m, caps), floor(t, caps)
            cap_m = m.split(".")[1] if floor(m, caps) == FLOORS.index("capabilities") else None
            cap_t = t.split(".")[1] if ft == FLOORS.index("capabilities") else None
            if t == "qosagent.daemon" and m not in DAEMON_USERS:
                out[(m, t)] = "only the daemon's endpoints import the daemon"
            elif t == "qosagent.capabilities" and m not in LIST_USERS:
                out[(m, t)] = "only the daemon, the CLI and status read the list of capabilities"
            elif ft > fm:
                out[(m, t)] = f"the {FLOORS[fm]} floor imports from the {FLOORS[ft]} floor"
            elif fm == FLOORS.index("bottom") and targets:
                out[(m, t)] = "the bottom floor imports nothing of the project"
            elif cap_m and cap_t and cap_m != cap_t and t != f"qosagent.{cap_t}.model":
                out[(m, t)] = f"{cap_m} imports {cap_t}'s modules beyond its typed part ({cap_t}/model.py)"
    return out


def test_the_rules_see_imports_wherever_they_are(tmp_path: Path) -> None:
    """The reader itself: function-level, TYPE_CHECKING and `from package import module` imports are edges, a circle
    through them is found, and a capability reaching into another is named."""
    pkg = tmp_path / "qosagent"
    for d in ("a", "b"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "capability.py").write_text("")
        (pkg / d / "model.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "face.py").write_text("def f():\n    from qosagent.a import capability\n")
    (pkg / "a" / "capability.py").write_text(
        "from typing import TYPE_CHECKING\nfrom qosagent import face\nif TYPE_CHECKING:\n"
        "    from qosagent.b.capability import B\nfrom qosagent.b.model import Part\n")
    (pkg / "hostfs.py").write_text("import qosagent.face\n")
    mods = modules(pkg)
    graph = imports(mods)
    assert lazy_imports(mods) == [("qosagent.face", 2, "qosagent.a")]
    assert graph["qosagent.face"] == {"qosagent.a.capability": 2}
    assert set(graph["qosagent.a.capability"]) == {"qosagent.face", "qosagent.b.capability", "qosagent.b.model"}
    assert circles(graph) == [frozenset({"qosagent.face", "qosagent.a.capability"})]
    found = offences(graph, capability_packages(pkg))
    assert set(found) == {("qosagent.face", "qosagent.a.capability"), ("qosagent.a.capability",
                          "qosagent.b.capability"), ("qosagent.hostfs", "qosagent.face")}


def test_no_import_circle() -> None:
    found = set(circles(imports(modules())))
    new = found - set(ALLOWED_CIRCLES)
    assert not new, "import circles: " + "; ".join(" ⇄ ".join(sorted(c)) for c in new)
    gone = set(ALLOWED_CIRCLES) - found
    assert not gone, f"no longer circles, take them out of ALLOWED_CIRCLES: {gone}"


def test_each_module_imports_only_its_own_floor_and_below() -> None:
    mods = modules()
    graph = imports(mods)
    found = offences(graph, capability_packages())
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, "\n".join(f"{mods[m].relative_to(ROOT)}:{graph[m][t]}: imports {t}: {why}"
                              for (m, t), why in sorted(new.items()))
    gone = set(ALLOWED) - set(found)
    assert not gone, f"no longer offences, take them out of ALLOWED: {sorted(gone)}"


def test_only_the_cli_imports_the_project_inside_functions() -> None:
    mods = modules()
    found = [f"{mods[m].relative_to(ROOT)}:{line}: imports {t}" for m, line, t in lazy_imports(mods)
             if m != "qosagent.cli"]
    assert not found, "imports of the project's modules inside functions (move them to the top):\n" + "\n".join(found)


def test_the_faces_import_no_implementation() -> None:
    """capability.py and services.py are what the daemon iterates over: neither knows a capability or a service."""
    graph = imports(modules())
    caps = capability_packages()
    for face in ("qosagent.capability", "qosagent.services"):
        below = {t for t in graph[face] if floor(t, caps) > FLOORS.index("shared")}
        assert not below, f"{face} imports {below}"
