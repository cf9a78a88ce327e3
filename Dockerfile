# syntax=docker/dockerfile:1
# Both images, one target each; build from the repository root (the distribution's pyproject.toml
# lives there):
#   docker build --target operator -t specdecode-operator:0.1.0 .
#   docker build --target worker   -t specdecode-worker:0.1.0 .
# operator: Python + kopf + the kubernetes client. No torch, no CUDA.
# worker: the planner (`specdecode-worker plan`, no GPU needed) and the server (`specdecode-worker
#   serve`) with CUDA torch; the operator sets the command and arguments. PyPI's Linux x86_64 torch
#   wheels are CUDA builds that ship their CUDA runtime libraries as nvidia-* wheels; the node's
#   driver is mounted by the NVIDIA container toolkit at run time.
#   Another CUDA line: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
# Each target builds only the stages it uses (BuildKit, buildah); the operator's come first, so
# that even a builder that runs every stage up to its target never installs torch for it.
# The bases are pinned by exact version; production builds may append an @sha256 digest.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/specdecode
ENV PATH=/opt/specdecode/bin:$PATH
WORKDIR /src

# The project as a wheel, the same for both images (one distribution holds both source roots).
FROM venv AS wheel
COPY pyproject.toml README.md ./
COPY operator/specdecode_operator operator/specdecode_operator
COPY worker/specdecode_worker worker/specdecode_worker
RUN pip wheel --no-deps --wheel-dir /wheels .

# What both images run as: the chart's numeric user (runAsNonRoot can check it), and the
# virtualenv, which each target copies to the same path as in its deps stage (the console scripts'
# shebangs point into it), then installs the wheel into as one small layer. pip check proves the
# dependencies complete. COPY, not RUN --mount: a builder's cache may key a RUN on its text alone
# and keep stale code.
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 specdecode \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin specdecode
ENV PATH=/opt/specdecode/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.licenses="Apache-2.0"

# Each image's dependencies in a stage with no project code, so a code change rebuilds neither it
# nor the runtime layer that copies it. pip resolves an extra's dependencies from the distribution
# with no packages (and an empty README) in place; the empty distribution is removed again.
FROM venv AS operator-deps
COPY pyproject.toml ./
# Only the [operator] extra: the worker's torch stack never enters this image.
RUN mkdir -p operator worker && touch README.md \
 && pip install --no-compile ".[operator]" \
 && pip uninstall --yes specdecode

FROM runtime AS operator
COPY --from=operator-deps /opt/specdecode /opt/specdecode
COPY --from=wheel /wheels /tmp/wheels
# The operator must import with no torch installed.
RUN PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 pip install --no-deps --no-compile /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels && pip check \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
 && python -c "import specdecode_operator"
LABEL org.opencontainers.image.title="specdecode-operator" \
      org.opencontainers.image.description="Kubernetes operator for SpecDecodeDeployment"
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["specdecode-operator"]

FROM venv AS worker-deps
ARG TORCH_VERSION=2.15.0
ARG TORCH_INDEX_URL=""
# torch first (its own index when asked), so the [worker] extra finds it satisfied; and before
# pyproject.toml, so that editing it does not download torch again.
RUN pip install --no-compile ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
COPY pyproject.toml ./
RUN mkdir -p operator worker && touch README.md \
 && pip install --no-compile ".[worker]" \
 && pip uninstall --yes specdecode

FROM runtime AS worker
# A home of its own for caches (Hugging Face, Triton) where no volume is mounted for them.
RUN install -d -o 10001 -g 10001 /home/specdecode && usermod --home /home/specdecode specdecode
COPY --from=worker-deps /opt/specdecode /opt/specdecode
COPY --from=wheel /wheels /tmp/wheels
RUN PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 pip install --no-deps --no-compile /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels && pip check \
 && specdecode-worker --help >/dev/null
LABEL org.opencontainers.image.title="specdecode-worker" \
      org.opencontainers.image.description="specdecode planner and speculative-decoding server (CUDA torch)"
ENV HOME=/home/specdecode \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/specdecode
EXPOSE 8000
ENTRYPOINT ["specdecode-worker"]
CMD ["--help"]
