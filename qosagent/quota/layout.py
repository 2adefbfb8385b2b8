"""The quota maps as the kernel holds them: ctypes mirrors of bpf/include/qos_quota.h, qos_flow.h and qos_common.h,
and what a pinned map must look like to be adopted."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from qosagent.ebpf.tenant_ports import PORTS, CidrKey, PortTenant

SLOTS = 4096  # QOS_SLOTS; slot 0 is the traffic of no tenant

QOS_LIMIT_REQ = 1
QOS_LIMIT_CONN = 2
QOS_LIMIT_OVERRIDE = 4
QOS_LIMIT_FLEET = 8
QOS_CONF_HEADER_RULES = 1
QOS_CONF_NETNS_RULES = 2

# QOS_STAT_*
STAT_REASONS = ("unmatched", "malformed", "fragment", "header_incomplete", "override_expired", "fleet_expired")
GEN_LINE = 8  # QOS_GEN_LINE: quota_gen past the slots' holds each CPU's stats generation, one cache line apart

VIA = {0: "none", 1: "port", 2: "cidr", 3: "header", 4: "netns"}  # QOS_VIA_*

TC_ACT_UNSPEC = -1
TC_ACT_SHOT = 2


class BucketLimit(ctypes.Structure):
    _fields_ = [("interval_ns", ctypes.c_uint64), ("tau_ns", ctypes.c_uint64)]


class QuotaLimit(ctypes.Structure):
    _fields_ = [("req", BucketLimit), ("conn", BucketLimit), ("override", BucketLimit), ("fleet", BucketLimit),
                ("fleet_until_ns", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("tenant", ctypes.c_uint32)]


class QuotaBucket(ctypes.Structure):
    _fields_ = [("req_tat", ctypes.c_uint64), ("conn_tat", ctypes.c_uint64)]


class QuotaCount(ctypes.Structure):
    _fields_ = [("req_admitted", ctypes.c_uint64), ("req_dropped", ctypes.c_uint64),
                ("conn_admitted", ctypes.c_uint64), ("conn_dropped", ctypes.c_uint64)]


class QuotaConf(ctypes.Structure):
    _fields_ = [("heartbeat_ns", ctypes.c_uint64), ("heartbeat_timeout_ns", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("rules_gen", ctypes.c_uint32)]


class AttachKey(ctypes.Structure):
    _fields_ = [("ifindex", ctypes.c_uint32), ("netns_ino", ctypes.c_uint32)]


class AttachVal(ctypes.Structure):
    _fields_ = [("created_clsact", ctypes.c_uint8), ("pad", ctypes.c_uint8 * 7)]


class NetnsKey(ctypes.Structure):
    _fields_ = [("ifindex", ctypes.c_uint32), ("port", ctypes.c_uint16), ("pad", ctypes.c_uint16)]


class FlowKey(ctypes.Structure):
    _fields_ = [("raddr", ctypes.c_uint8 * 16), ("laddr", ctypes.c_uint8 * 16), ("rport", ctypes.c_uint16),
                ("lport", ctypes.c_uint16)]


class FlowVal(ctypes.Structure):
    _fields_ = [("tenant", ctypes.c_uint32), ("via", ctypes.c_uint8), ("pad", ctypes.c_uint8),
                ("slot", ctypes.c_uint16)]


# BPF_MAP_TYPE_*
HASH, ARRAY, PROG_ARRAY, PERCPU_ARRAY, LRU_HASH, LPM_TRIE = 1, 2, 3, 6, 9, 11


@dataclass(frozen=True)
class MapSpec:
    type: int
    key_size: int
    value_size: int


def map_specs(flow_entries: int) -> dict[str, tuple[MapSpec, int]]:
    """Every pinned map: its spec and max_entries (a pin that differs in any is not adopted)."""
    port, tval = 4, 4
    return {
        "tenant_ports": (MapSpec(ARRAY, 4, ctypes.sizeof(PortTenant)), PORTS),
        "tenant_cidrs": (MapSpec(LPM_TRIE, ctypes.sizeof(CidrKey), tval), 4096),
        "watched_ports": (MapSpec(HASH, port, 1), 1024),
        "tenant_flows": (MapSpec(LRU_HASH, ctypes.sizeof(FlowKey), ctypes.sizeof(FlowVal)), flow_entries),
        "quota_headers": (MapSpec(HASH, 8, tval), 1024),
        "quota_slots": (MapSpec(HASH, tval, 4), SLOTS),
        "quota_limits": (MapSpec(ARRAY, 4, ctypes.sizeof(QuotaLimit)), SLOTS),
        "quota_buckets": (MapSpec(ARRAY, 4, ctypes.sizeof(QuotaBucket)), SLOTS),
        "quota_counters": (MapSpec(PERCPU_ARRAY, 4, ctypes.sizeof(QuotaCount)), SLOTS),
        "quota_stats": (MapSpec(PERCPU_ARRAY, 4, 8), len(STAT_REASONS)),
        "quota_config": (MapSpec(ARRAY, 4, ctypes.sizeof(QuotaConf)), 1),
        "quota_attach": (MapSpec(HASH, ctypes.sizeof(AttachKey), ctypes.sizeof(AttachVal)), 256),
        "quota_netns": (MapSpec(HASH, ctypes.sizeof(NetnsKey), tval), 1024),
        "quota_progs": (MapSpec(PROG_ARRAY, 4, 4), 1),
    }
