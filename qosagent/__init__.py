"""qosagent: per-tenant latency SLOs for GPU inference hosts, measured and enforced in the kernel."""

__version__ = "0.2.0"
