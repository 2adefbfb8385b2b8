from __future__ import annotations

from qosagent.configbase import Mode, Section


class AdmissionConfig(Section):
    enabled: bool = False
    mode: Mode = "dry-run"
