"""Log lines name their component once: the formatter puts the logger's component in front of every message, so a
message that starts with it again would read "latency: latency: ...". Checked over the agent's source."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

from qosagent.logs import JournalFormatter

SRC = Path(__file__).resolve().parents[2] / "qosagent"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def test_the_formatter_names_the_component() -> None:
    rec = logging.LogRecord("qosagent.latency", logging.WARNING, __file__, 1, "probes %s", ("detached",), None)
    assert JournalFormatter().format(rec) == "<4>latency: probes detached"


def _leading_text(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return ""


def test_no_message_repeats_its_components_name() -> None:
    doubled = []
    checked = 0
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        named = re.search(r'getLogger\("qosagent\.([a-z_]+)"\)', text)
        # A capability's self.log is qosagent.<its package>.
        components = {named.group(1)} if named else set()
        components.add(path.parent.name)
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and node.args):
                continue
            target = node.func.value
            if not ((isinstance(target, ast.Name) and target.id == "log")
                    or (isinstance(target, ast.Attribute) and target.attr == "log")):
                continue
            lead = _leading_text(node.args[0])
            checked += bool(lead)
            if any(lead.startswith(f"{c}: ") for c in components):
                doubled.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {lead[:40]!r}")
    # The walk must have found the agent's messages, or the check below holds of nothing.
    assert checked > 50, checked
    assert not doubled, "messages that repeat the component the formatter adds:\n" + "\n".join(doubled)
