# One image for every gpupart component: the entrypoint is `gpupart`, the command picks the
# component (`operator`, `node`, `extender`, `simulate`, `plan`).
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
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gpupart
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels gpupart && rm -rf /wheels
# Non-root by default; the node DaemonSet overrides this where NVML needs privileges.
USER 10001
ENTRYPOINT ["gpupart"]
CMD ["--help"]
