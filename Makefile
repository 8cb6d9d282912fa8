# The two set-up commands of the README:
#   make demo   creates .venv, installs netweave, and runs `netweave demo`
#   make test   does the same set-up (plus, as root, the Debian packages for
#               Mininet emulation) and runs the whole test suite
# Both are idempotent: a second run only re-installs when pyproject.toml changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.netweave-installed
DEB_PACKAGES := mininet bridge-utils iperf3 iputils-ping ethtool
DEMO_OUT ?= netweave-demo

.PHONY: demo test setup csrc sysdeps lint bench clean

demo: setup
	$(BIN)/netweave demo --out $(DEMO_OUT)

# --durations: the slowest tests in every run's log (the suite's budget is 20 minutes on CI's two cores)
test: setup sysdeps
	$(BIN)/python -m pytest -q --durations=25

setup: $(STAMP) csrc

# The NCCL plugin library and LD_PRELOAD marker (gcc and libc only; incremental).
csrc:
	@$(MAKE) -s -C csrc all

$(STAMP): pyproject.toml
	@if ! $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip; fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: this installs the CPU build from the local wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	@touch $(STAMP)

# Mininet, Linux bridges, iperf3 and ping for the emulation backend (root only).
sysdeps:
	@if [ "$$(id -u)" = 0 ]; then \
		missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
		if [ -n "$$missing" ]; then echo "installing:$$missing"; apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi; \
	else echo "not root: skipping Debian packages ($(DEB_PACKAGES)); emulation tests will skip"; fi

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/netweave bench all

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .ruff_cache
	$(MAKE) -C csrc clean
