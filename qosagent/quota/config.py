from __future__ import annotations

from qosagent.configbase import Section


class QuotaConfig(Section):
    enabled: bool = False
