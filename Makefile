# The two commands a new user needs (README): `make run` and `make test`.
# Everything else is a step they depend on. Only Python 3.11+, make and a C compiler are assumed.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: setup native helm promtool image run test test-fast lint typecheck unit bench clean cluster cluster-up cluster-down cluster-clean e2e test-gpu

setup: $(STAMP) native

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

# Helm, built from the module hack/cluster/modules/helm pins (the module proxy only), for the
# chart's tests (tests/test_deploy_helm.py, tests/e2e/test_e2e_helm.py). Without Go they skip.
HELM_MODULE = hack/cluster/modules/helm
HELM = .build/helm/helm
helm: $(HELM)
$(HELM): $(HELM_MODULE)/go.mod $(HELM_MODULE)/go.sum
	@if command -v go >/dev/null; then \
	  echo "building helm $$(awk '$$1 == "helm.sh/helm/v3" {print $$2}' $(HELM_MODULE)/go.mod) from the module proxy"; \
	  cd $(HELM_MODULE) && CGO_ENABLED=0 go build -mod=readonly -trimpath \
	    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$$(awk '$$1 == "helm.sh/helm/v3" {print $$2}' go.mod)" \
	    -o $(abspath .build/helm)/ tool; \
	else echo "no Go toolchain: helm is not built and the Helm chart tests skip"; fi

# promtool, built from the module hack/cluster/modules/promtool pins (the module proxy only), with
# the cluster build's Go caches (.build/go): `promtool check rules` and `promtool test rules` run
# on deploy/monitoring (tests/test_deploy_monitoring_promtool.py). Without Go those tests skip.
PROMTOOL_MODULE = hack/cluster/modules/promtool
PROMTOOL = .build/promtool/promtool
promtool: $(PROMTOOL)
$(PROMTOOL): $(PROMTOOL_MODULE)/go.mod $(PROMTOOL_MODULE)/go.sum
	@if command -v go >/dev/null; then \
	  m=$$(awk '$$1 == "github.com/prometheus/prometheus" {print $$2}' $(PROMTOOL_MODULE)/go.mod); \
	  v=$$(echo $$m | awk -F. '{print int($$2 / 100) "." $$2 % 100 "." $$3}'); \
	  echo "building promtool $$v (github.com/prometheus/prometheus $$m) from the module proxy"; \
	  cd $(PROMTOOL_MODULE) && GOTOOLCHAIN=local GOMODCACHE=$(abspath .build/go/mod) GOCACHE=$(abspath .build/go/cache) \
	    CGO_ENABLED=0 go build -mod=readonly -trimpath -buildvcs=false \
	    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$$v" \
	    -o $(abspath .build/promtool)/ tool; \
	else echo "no Go toolchain: promtool is not built and the alert rule tests skip"; fi

native:
	@if [ -f native/Makefile ]; then $(MAKE) -s -C native PYTHON=$(abspath $(BIN)/python); fi

# Runs the admission webhook standalone on https://127.0.0.1:8443 with a certificate it issues.
run: setup
	$(BIN)/fracgpu serve --standalone

# The layers (import contracts), ruff, and the size caps on product modules (hack/sizes.py).
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python hack/sizes.py
	$(BIN)/ruff check .
	$(BIN)/ruff format --check core fracgpu webhook quota deviceplugin certs extender tests testkit bench hack

typecheck: $(STAMP)
	$(BIN)/mypy

unit: setup helm promtool
	$(BIN)/pytest -q

# The edit-test loop: unit tests only (no native throttle timing, no e2e, no GPU), in well under
# a minute. `make test` stays the whole suite that CI runs.
test-fast: setup
	$(BIN)/pytest -q -m "not slow" -x

# The whole test suite: lint, types, then every pytest suite (the native ones included).
test: lint typecheck unit

# On a machine with an NVIDIA GPU (docs/testing.md): the hook under PyTorch, NVML inventory,
# health and the guard, then the hook's cost on the real driver. GPU_PYTHON is the interpreter
# that has torch and fracgpu's dependencies. Each test file runs in its own process: pynvml
# binds its library once per process, and the device-plugin suite must get the real one.
GPU_PYTHON ?= $(BIN)/python
test-gpu:
	@status=0; \
	$(GPU_PYTHON) -m pytest -p no:cacheprovider -m gpu tests/test_native_gpu.py -v -s || status=1; \
	$(GPU_PYTHON) -m pytest -p no:cacheprovider -m gpu tests/test_native_gpu_share.py -v -s || status=1; \
	$(GPU_PYTHON) -m pytest -p no:cacheprovider -m gpu tests/test_deviceplugin_gpu.py -v -s || status=1; \
	$(GPU_PYTHON) -m bench.native_gpu || status=1; \
	exit $$status

# The project's real cluster (hack/cluster, docs/testing.md): Kubernetes, etcd and containerd built
# from Go modules; one node on loopback, as root. KUBE_VERSION picks 1.36 or 1.37 (the default).
KUBE_VERSION ?= 1.37
export KUBE_VERSION

cluster:
	hack/cluster/build.sh

cluster-up: cluster
	hack/cluster/up.sh

cluster-down:
	hack/cluster/down.sh

# The cluster's binaries, images and Go caches (Go keeps its module cache read-only).
cluster-clean:
	@[ ! -d .build ] || { chmod -R u+w .build && rm -rf .build; }

# fracgpu's image, built from the Dockerfile on a Debian base with no registry (hack/image/build.sh,
# docs/install.md): an OCI archive in .build/cluster/images that cluster-up imports. As root.
image:
	hack/image/build.sh

# The e2e suite on that cluster, device-plugin mode then DRA mode; nothing may be skipped.
e2e: setup cluster helm image
	hack/cluster/e2e.sh

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) native/build .pytest_cache .mypy_cache .ruff_cache
