from __future__ import annotations

from qosagent.capability import Capability, State, Verdict


class Dvfs(Capability):
    name = "dvfs"

    def probe(self, features: object) -> Verdict:
        return Verdict(State.UNAVAILABLE, "not built yet")
