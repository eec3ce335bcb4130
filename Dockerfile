# One image for `pagedmodel serve`, `pagedmodel router` and `pagedmodel operator`.
#
# CUDA: PyPI's Linux torch wheels bundle the CUDA runtime (nvidia-* wheels), so a plain Python base is
# CUDA-capable; the host's NVIDIA container toolkit injects the driver. Triton JIT-compiles a small
# launcher at run time and the CPU attention op (pagedmodel/kernels/cpu_paged_attention.cpp) is built on first use,
# hence gcc, g++ and ninja in the final stage.
#
# Not built in CI: our machines have no container engine (and the build downloads torch + the default
# model from PyPI). Build with:  docker build -t ghcr.io/pagedmodel/pagedmodel:0.1.0 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagedmodel ./pagedmodel
COPY server ./server
COPY operator ./operator
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ ninja-build libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/pagedmodel pagedmodel
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels

# The default model lives in the image, so `builtin://smollm2` needs no network and no writable disk.
# Scratch (Triton/inductor caches) goes to /tmp, an emptyDir in the operator's pods (read-only root).
ENV PAGEDMODEL_CACHE_DIR=/opt/pagedmodel/cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    HF_HOME=/tmp/huggingface \
    PYTHONUNBUFFERED=1
RUN pagedmodel models pull smollm2 && chmod -R a+rX /opt/pagedmodel

USER 1000:1000
WORKDIR /home/pagedmodel
EXPOSE 8000
ENTRYPOINT ["pagedmodel"]
CMD ["serve", "--host", "0.0.0.0"]
