# The kvfleet image: gateway (`kvfleet gateway --config ...`) and operator (`kvfleet operator`).
# Engines run the SGLang image (spec.engine.image), not this one.
#   docker build -t ghcr.io/kvfleet/kvfleet:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
# The product alone: no stand-in (sim/, localcluster/, bench/) and no extra is in the image.
# .ci/run builds the same install (.ci/runtime_only.py) and runs it against the local cluster.
COPY kernel kernel
COPY operator operator
COPY gateway gateway
COPY cli cli
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvfleet
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Read-only root filesystem in the pod: nothing is written outside /tmp (an emptyDir).
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["kvfleet"]
CMD ["--help"]
