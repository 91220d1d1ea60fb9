# syntax=docker/dockerfile:1
# One image for every gpupart component: the entrypoint is `gpupart`, the command picks the
# component (`operator`, `node`, `extender`, `simulate`, `plan`).
# Build: docker build -t gpupart:0.1.0 .   (BuildKit: the final stage mounts the wheels)
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpupart ./gpupart
COPY operator ./operator
COPY plugin ./plugin
COPY extender ./extender
# Wheels for gpupart and every dependency, so the final stage needs no compiler or network.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG GPUPART_VERSION=0.1.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# The wheels are mounted for this step only (no layer keeps them); pip, setuptools and wheel
# leave the image afterwards: nothing installs packages at run time.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels "gpupart==${GPUPART_VERSION}" \
    && python -m pip uninstall --yes pip setuptools wheel \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gpupart
# Non-root by default; the node DaemonSet runs as root (privileged) where NVML needs it.
USER 10001:10001
ENTRYPOINT ["gpupart"]
CMD ["--help"]
