# vLLM's CPU build as a worker image for `runtime.engine: vllm` on the test bed's real node, from
# the same pins as the engine venv the CPU tests serve with (devtools/engines/vllm.txt, and the
# package its "# no-deps:" line names). Built by `images/build.sh vllm-cpu`; not a production image
# (on GPUs, runtime.image names vLLM's own).
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
FROM ${PYTHON_IMAGE}
# vLLM's CPU kernels link libnuma.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/*
# The user the operator's restricted pods run as (podsecurity.IMAGE_UID), with a home for caches.
RUN groupadd --system --gid 10001 specdecode \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/specdecode \
      --shell /usr/sbin/nologin specdecode
ARG ENGINE_PACKAGE
COPY devtools/engines/vllm.txt /tmp/pins.txt
# One layer: the venv's pins, then the engine without its requirements (it pins a torch build that
# PyPI does not serve; PyPI's CUDA build runs on the CPU).
RUN test -n "$ENGINE_PACKAGE" \
 && python -m venv /opt/vllm \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/vllm/bin/pip install --progress-bar off --no-compile -r /tmp/pins.txt \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/vllm/bin/pip install --quiet --no-compile --no-deps "$ENGINE_PACKAGE" \
 && rm /tmp/pins.txt
ENV PATH=/opt/vllm/bin:$PATH \
    HOME=/home/specdecode \
    PYTHONUNBUFFERED=1 \
    VLLM_NO_USAGE_STATS=1 \
    HF_HUB_OFFLINE=1
LABEL org.opencontainers.image.title="specdecode-vllm-cpu" \
      org.opencontainers.image.description="vLLM's CPU build for the specdecode test bed's real node"
USER 10001:10001
WORKDIR /home/specdecode
EXPOSE 8000
ENTRYPOINT []
CMD ["python3", "-m", "vllm.entrypoints.openai.api_server", "--help"]
