"""No module decides by a capability's or service's name (docs/ARCHITECTURE.md, "Capabilities"): what a capability
needs of the agent or of the others is a class attribute (uses, offers, loads_bpf) or its plan, never
`cls.name in ("latency", "quota")` or `verdicts["quota"]`. Read from the sources with ast."""

from __future__ import annotations

import ast
from pathlib import Path

from qosagent.capabilities import CAPABILITIES, services
from tests.unit.test_imports import ROOT, modules

NAMES = {k.name for k in CAPABILITIES} | {s.name for s in services(CAPABILITIES)}


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for e in node.elts for s in _strings(e)}
    return set()


def by_name(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of each comparison of a `.name` with a capability's or service's name, and of each look-up of a
    verdict or a service by a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if (any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
                    and set().union(*map(_strings, sides)) & NAMES):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
            if node.value.attr in ("verdicts", "services") and _strings(node.slice) & NAMES:
                out.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
              and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in ("verdicts", "services")
              and node.args and _strings(node.args[0]) & NAMES):
            out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def test_the_reader_finds_each_kind_of_decision_by_name() -> None:
    code = ('if any(c.name in ("latency", "quota") for c in caps): pass\n'
            'q = ctx.verdicts.get("quota")\n'
            'p = agent.ctx.services.pop("pods", None)\n'
            'v = self.verdicts["latency"]\n'
            'ok = "servers" not in status and part("quota")\n')
    assert [line for line, _ in by_name(ast.parse(code))] == [1, 2, 3, 4]


def test_no_module_decides_by_a_capability_s_name() -> None:
    found = [f"{Path(p).relative_to(ROOT)}:{line}: {code}" for p in modules().values()
             for line, code in by_name(ast.parse(p.read_text(), str(p)))]
    assert not found, "decided by name (a class attribute or the plan should say it):\n" + "\n".join(found)
