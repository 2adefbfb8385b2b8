"""Every constant and struct layout Python mirrors from the BPF C (bpf/include/*.h, bpf/*.c), checked against the C
as written: a header changed alone fails here, before any kernel sees the mismatch as wrong numbers."""

from __future__ import annotations

import ctypes

import pytest

from qosagent import hist, tenants
from qosagent.ebpf import maps, pins, tenant_ports
from qosagent.latency import bpfmaps as bm
from qosagent.latency import pods as latency_pods
from qosagent.latency.cgroupwatch import CgroupEvent
from qosagent.quota import layout, rules
from tests.bpf_headers import Headers, Struct


@pytest.fixture(scope="module")
def c() -> Headers:
    return Headers()


MIRRORS = [
    (tenant_ports.PortTenant, "qos_port_tenant"),
    (tenant_ports.CidrKey, "qos_cidr_key"),
    (tenant_ports.TenantVal, "qos_tenant_val"),
    (layout.BucketLimit, "qos_bucket_limit"),
    (layout.QuotaLimit, "qos_quota_limit"),
    (layout.QuotaBucket, "qos_quota_bucket"),
    (layout.QuotaCount, "qos_quota_count"),
    (layout.QuotaConf, "qos_quota_conf"),
    (layout.AttachKey, "qos_attach_key"),
    (layout.AttachVal, "qos_attach_val"),
    (layout.FlowKey, "qos_flow_key"),
    (layout.FlowVal, "qos_flow_val"),
    (CgroupEvent, "lat_cgroup_event"),
]


def ctypes_layout(t: type) -> list[tuple[str, int, int]]:
    return [(name, getattr(t, name).offset, getattr(t, name).size) for name, *_ in t._fields_]


def c_layout(s: Struct) -> list[tuple[str, int, int]]:
    return [(f.name, f.offset, f.size) for f in s.fields]


@pytest.mark.parametrize(("mirror", "struct"), MIRRORS, ids=[s for _, s in MIRRORS])
def test_ctypes_mirror_has_the_layout_of_the_c_struct(c: Headers, mirror: type, struct: str) -> None:
    s = c.struct(struct)
    assert ctypes_layout(mirror) == c_layout(s), f"{mirror.__name__} differs from struct {struct}"
    assert ctypes.sizeof(mirror) == s.size


def test_latency_rows_and_counters(c: Headers) -> None:
    assert bm.ROW_SIZE == c.struct("lat_row").size
    assert c_layout(c.struct("lat_row")) == [("sum_ns", 0, 8), ("count", 8, 8 * hist.NBUCKETS)]
    assert c.struct("lat_counts").size == 8 * bm.NCOUNTERS
    assert c_layout(c.struct("qos_gen")) == [("n", 0, maps.GEN_SIZE)]


def constants() -> list[tuple[str, int]]:
    """(C #define, the value Python holds for it)."""
    out = [
        ("QOS_UNMATCHED", tenants.UNMATCHED_ID),
        ("QOS_CIDR_PORT_BITS", tenants.CIDR_PORT_BITS),
        ("QOS_PORTS", tenant_ports.PORTS),
        ("QOS_HIST_SUB_BITS", hist.SUB_BITS),
        ("QOS_HIST_SUB", hist.SUB),
        ("QOS_HIST_MAX_LOG2", hist.MAX_LOG2),
        ("QOS_HIST_NBUCKETS", hist.NBUCKETS),
        ("QOS_QUOTA_LAYOUT", pins.QUOTA_LAYOUT),
        ("QOS_SLOTS", layout.SLOTS),
        ("QOS_LIMIT_REQ", layout.QOS_LIMIT_REQ),
        ("QOS_LIMIT_CONN", layout.QOS_LIMIT_CONN),
        ("QOS_LIMIT_OVERRIDE", layout.QOS_LIMIT_OVERRIDE),
        ("QOS_CONF_HEADER_RULES", layout.QOS_CONF_HEADER_RULES),
        ("QOS_STAT_MAX", len(layout.STAT_REASONS)),
        ("QOS_GEN_LINE", layout.GEN_LINE),
        ("QOS_MAX_NS", rules.MAX_NS),
        ("LAT_KINDS", bm.KINDS),
        ("LAT_NCOUNTERS", bm.NCOUNTERS),
        ("LAT_NO_SLOT", bm.NO_SLOT),
        ("LAT_NETNS_MAX", latency_pods.MAX_ENTRIES),
    ]
    out += [(f"QOS_STAT_{reason.upper()}", i) for i, reason in enumerate(layout.STAT_REASONS)]
    out += [(f"QOS_VIA_{via.upper()}", i) for i, via in layout.VIA.items()]
    out += [(f"LAT_{name}", getattr(bm, name)) for name in dir(bm) if name.startswith(("KIND_", "C_"))]
    return out


@pytest.mark.parametrize(("define", "value"), constants(), ids=[d for d, _ in constants()])
def test_constant_matches_its_define(c: Headers, define: str, value: int) -> None:
    assert c.define(define) == value


def test_no_ttft_reasons_name_every_counter_of_the_kind(c: Headers) -> None:
    kernel = {n for n in c.defines if n.startswith("LAT_C_NOTTFT_")}
    assert {f"LAT_C_NOTTFT_{'LONG' if r == 'header_too_long' else r.upper()}" for r in bm.NO_TTFT_REASONS} == kernel
    assert {v for v in bm.NO_TTFT_REASONS.values()} == {c.define(n) for n in kernel}


def test_every_latency_counter_is_mirrored(c: Headers) -> None:
    """A counter added to the kernel without a Python name would be summed and never reported."""
    assert {n for n in c.defines if n.startswith("LAT_C_")} == {f"LAT_{n}" for n in dir(bm) if n.startswith("C_")}
    assert {n for n in c.defines if n.startswith("LAT_KIND_")} == {
        f"LAT_{n}" for n in dir(bm) if n.startswith("KIND_")}


_KINDS = {"hash": layout.HASH, "array": layout.ARRAY, "prog": layout.PROG_ARRAY, "percpu_array": layout.PERCPU_ARRAY,
          "lru_hash": layout.LRU_HASH, "lpm_trie": layout.LPM_TRIE}


def test_pinned_quota_maps_are_specified_as_declared(c: Headers) -> None:
    """What an adopted pin is checked against (layout.map_specs) is what bpf/quota.c declares."""
    flows = 12345
    declared = c.maps("quota")
    specs = layout.map_specs(flows)
    for name, (spec, entries) in specs.items():
        d = declared[name]
        want_entries = flows if d.max_entries == "QOS_FLOWS" else c.eval(d.max_entries)
        assert (spec.type, spec.key_size, spec.value_size, entries) == (
            _KINDS[d.kind], c.sizeof(d.key), c.sizeof(d.value), want_entries), name
    pinned = {n for n, d in declared.items() if n not in ("quota_flow_l1", "quota_scan", "quota_gen")}
    assert set(specs) == pinned  # the per-CPU scratch maps are the program's own, never pinned


def test_the_parser_sees_a_changed_header(tmp_path) -> None:
    """The checks above can fail: the same parser on a copy of qos_quota.h with a field added reads another layout."""
    from tests.bpf_headers import BPF

    text = (BPF / "include" / "qos_quota.h").read_text()
    changed = tmp_path / "qos_quota.h"
    changed.write_text(text.replace("    __u32 rules_gen;", "    __u32 rules_gen;\n    __u64 added;"))
    assert Headers([changed]).struct("qos_quota_conf").size != ctypes.sizeof(layout.QuotaConf)


def test_every_latency_entry_file_is_built_by_some_plan() -> None:
    """One entry file per attach point (bpf/latency_*.c), each reached by a plan: a file no plan names is dead code
    the layout checks above would still read."""
    import itertools

    from qosagent.latency.datapath import sources
    from qosagent.latency.model import Plan
    from tests.bpf_headers import BPF

    built = {name for mode, arrival, egress, runq in itertools.product(("sockops", "tracepoint", "kprobe"),
                                                                       *[(False, True)] * 3)
             for name in sources(Plan(mode, arrival, egress, runq))}
    assert built == {p.stem for p in BPF.glob("latency_*.c")}


def test_a_header_first_included_under_an_ifdef_is_pasted_again_where_needed(tmp_path) -> None:
    """The loader pastes a header at every include, its guard keeping a second copy empty: a header an entry file
    includes only under an #ifdef must still reach the next entry file that includes it unconditionally."""
    from qosagent.ebpf.loader import inline_includes

    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "a.h").write_text('#ifndef A_H\n#define A_H\n#include "b.h"\nint a;\n#endif\n')
    (inc / "b.h").write_text('#ifndef B_H\n#define B_H\n#include "a.h"\nint b;\n#endif\n')  # a cycle
    (tmp_path / "one.c").write_text('#ifdef X\n#include "a.h"\n#endif\n#include <linux/types.h>\n')
    (tmp_path / "two.c").write_text('#include "a.h"\n')
    text = inline_includes(tmp_path / "one.c", inc) + inline_includes(tmp_path / "two.c", inc)
    assert text.count("int a;") == 2 and text.count("int b;") == 2  # once inside #ifdef X, once outside
    assert "#include <linux/types.h>" in text and '#include "' not in text
