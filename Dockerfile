# One image for every Python component of fracgpu (fracgpu serve | quota | certs | device-plugin),
# with the CUDA hook libfracgpu.so that the device plugin's init container puts on each GPU node.
#
#   docker build -t REGISTRY/fracgpu:TAG .
#
# The base is pinned by version in this one place; pin it by digest in your own build
# (--build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:...) for reproducible images.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# --- the hook: plain C, built with the distribution's gcc ---------------------------------------
FROM ${PYTHON_IMAGE} AS hook
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The C header is generated from the Python contract module at build time (native/Makefile).
COPY core/ core/
COPY native/ native/
RUN make -C native PYTHON=python3 CC=gcc \
 && test -f native/build/libfracgpu.so

# --- the Python distribution, installed into a virtual environment with pinned dependencies ----
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY core/ core/
COPY fracgpu/ fracgpu/
COPY webhook/ webhook/
COPY quota/ quota/
COPY deviceplugin/ deviceplugin/
COPY certs/ certs/
COPY extender/ extender/
# A build behind a TLS-intercepting proxy passes its CA bundle as the secret pip-ca
# (`make image` passes the build machine's); without it pip uses the base's certificates.
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install -c constraints.txt . \
 && /opt/venv/bin/pip uninstall -y pip \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

# --- runtime: the slim base, the virtual environment and the hook; no compiler, no pip ---------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="fracgpu" \
      org.opencontainers.image.description="Fractional NVIDIA GPUs for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=wheel /opt/venv /opt/venv
# deploy/base/device-plugin.yaml (init container install-hook) copies it from here to the node.
COPY --from=hook /src/native/build/libfracgpu.so /opt/fracgpu/lib/libfracgpu.so
# The webhook and the scheduler-side components run as this unprivileged user (the manifests
# set the same uid); only the device plugin overrides it with root, for kubelet's socket dirs.
USER 65532:65532
ENTRYPOINT ["fracgpu"]
CMD ["--help"]
