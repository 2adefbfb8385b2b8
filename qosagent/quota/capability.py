from __future__ import annotations

from qosagent.capability import Capability, State, Verdict


class Quota(Capability):
    name = "quota"

    def probe(self, features: object) -> Verdict:
        return Verdict(State.UNAVAILABLE, "not built yet")
