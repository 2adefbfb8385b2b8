# The two commands that matter: `make run` and `make test` (each sets up what is missing first).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-test setup-kernels run test test-kernels lint bench clean install install-files install-agent demo \
	install-dropin uninstall

setup:
	@scripts/setup.sh

setup-test:
	@QOSAGENT_SETUP_TEST=1 scripts/setup.sh

run: setup
	$(PY) -m qosagent run $(ARGS)

# The whole suite: natively on this host's kernel, then (tests/vm, collected last) the kernel matrix, where Debian 12's
# 6.1 and Debian 13's 6.12, one after the other in a QEMU VM with two NUMA nodes, run the kernel-dependent tests
# (8-13 and ~9 minutes under emulation), Debian 11's 5.10 checks the agent's refusal (under 2 minutes), and the
# shipped unit runs under systemd as PID 1 in a fourth boot (7-12 minutes).
test: setup-test setup-kernels lint
	$(PY) -m pytest $(PYTEST_ARGS)

setup-kernels:
	@QOSAGENT_SETUP_TEST=1 QOSAGENT_SETUP_VM=1 scripts/setup.sh

# The kernel matrix alone.
test-kernels: setup-kernels
	$(PY) -m pytest -m kernel_matrix tests/vm $(PYTEST_ARGS)

lint: setup-test
	$(VENV)/bin/ruff check .

# Each benchmark prints its measurements (ratios against a baseline taken in the same run) for docs/PERFORMANCE.md.
bench: setup-test
	$(PY) -m bench.latency_overhead
	$(PY) bench/quota_bench.py
	$(PY) bench/quota_wire_bench.py
	$(PY) bench/quota_netns_bench.py
	$(PY) -m bench.dvfs_collect
	$(PY) bench/placement_bench.py
	$(PY) bench/ship_metrics.py
	$(PY) bench/map_access.py
	$(PY) bench/fleet_bench.py
	$(PY) bench/metrics_aliases.py
	$(PY) bench/scale_scrape.py
	$(PY) -m bench.admission_decide
	$(PY) bench/llamacpp_bench.py
	$(PY) bench/resources_bench.py
	$(PY) -m bench.scale_tenants

# The agent at work on this host alone: a namespace, a streaming server, two tenants, a quota (about 30 s).
demo: setup
	@PY=$(PY) scripts/demo.sh

# Installing as a service. DESTDIR stages the files for a package (or a test); the agent's venv is built only for a
# real install, because a venv is not relocatable.
# The unit's ExecStart and ExecReload name this directory.
PREFIX := /opt/qosagent
UNITDIR ?= /etc/systemd/system
CONFDIR ?= /etc/qosagent
DATADIR ?= /usr/share/qosagent
DOCDIR ?= /usr/share/doc/qosagent

install: install-agent install-files install-dropin

install-files:
	install -D -m 0644 systemd/qosagent.service $(DESTDIR)$(UNITDIR)/qosagent.service
	install -D -m 0644 systemd/qosagent-allocator.service $(DESTDIR)$(UNITDIR)/qosagent-allocator.service
	@# An operator's config is never overwritten.
	@if [ -e $(DESTDIR)$(CONFDIR)/config.yaml ]; then echo "install: keeping $(DESTDIR)$(CONFDIR)/config.yaml"; \
	 else install -D -m 0644 qosagent/default.yaml $(DESTDIR)$(CONFDIR)/config.yaml; fi
	install -d $(DESTDIR)$(DATADIR)/bpf/include
	install -m 0644 bpf/include/*.h $(DESTDIR)$(DATADIR)/bpf/include/
	$(if $(wildcard bpf/*.c),install -m 0644 $(wildcard bpf/*.c) $(DESTDIR)$(DATADIR)/bpf/)
	install -D -m 0644 docs/operations.md $(DESTDIR)$(DOCDIR)/operations.md
	install -D -m 0644 docs/fleet.md $(DESTDIR)$(DOCDIR)/fleet.md

install-agent:
	@if [ -n "$(DESTDIR)" ]; then echo "install: DESTDIR set, not building the agent's venv at $(PREFIX)"; else \
	  scripts/setup.sh && /usr/bin/python3 -m venv --system-site-packages $(PREFIX) && \
	  $(PREFIX)/bin/pip install -q --disable-pip-version-check . ; fi

# The unit grants what the default config needs; what the installed config's capabilities need beyond it (placement's
# SYS_NICE, quota's bpffs, ...) is a drop-in, written from that config (`qosagent check --systemd`); none when the
# unit is enough. Edit the config to enable a capability, then `make install-dropin` (or write what check prints).
install-dropin:
	@if [ -n "$(DESTDIR)" ]; then echo "install: DESTDIR set, no drop-in (run qosagent check --systemd on the host)"; \
	 else d=$(UNITDIR)/qosagent.service.d; t=$$(mktemp); \
	  $(PREFIX)/bin/qosagent check --systemd --config $(CONFDIR)/config.yaml >$$t || { rm -f $$t; exit 1; }; \
	  if grep -q '^\[' $$t; then install -D -m 0644 $$t $$d/capabilities.conf; \
	   echo "install: $$d/capabilities.conf grants what $(CONFDIR)/config.yaml needs beyond the unit"; \
	  else rm -f $$d/capabilities.conf; rmdir $$d 2>/dev/null || true; fi; rm -f $$t; \
	  systemctl daemon-reload 2>/dev/null || true; fi

# A stopped agent leaves quota's filter and pins enforcing for the next one (the handover): uninstalling stops the
# unit, then removes them with `qosagent detach`, then the files. The operator's config stays.
uninstall:
	-systemctl disable --now qosagent
	@if [ -x $(PREFIX)/bin/qosagent ]; then $(PREFIX)/bin/qosagent detach --config $(CONFDIR)/config.yaml; \
	 else echo "uninstall: no $(PREFIX)/bin/qosagent; run qosagent detach by hand if the agent ran"; fi
	-rmdir /run/qosagent 2>/dev/null  # empty once detach restored everything (RuntimeDirectoryPreserve=yes)
	rm -f $(DESTDIR)$(UNITDIR)/qosagent.service
	rm -f $(DESTDIR)$(UNITDIR)/qosagent.service.d/capabilities.conf
	-rmdir $(DESTDIR)$(UNITDIR)/qosagent.service.d 2>/dev/null
	rm -rf $(DESTDIR)$(DATADIR) $(DESTDIR)$(DOCDIR) $(PREFIX)
	-systemctl daemon-reload
	@echo "uninstall: kept $(CONFDIR)/config.yaml"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
