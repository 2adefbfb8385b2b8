from __future__ import annotations

from qosagent.capability import Capability, State, Verdict


class Admission(Capability):
    name = "admission"

    def probe(self, features: object) -> Verdict:
        return Verdict(State.UNAVAILABLE, "not built yet")
