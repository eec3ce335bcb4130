# One image for `pagedmodel serve`, `pagedmodel router` and `pagedmodel operator`.
#
# The CPU ops (the C++ in kernels/) are compiled in the build stage, once per x86-64 level (AVX2, AVX-512,
# AVX-512 BF16, AMX), into the wheel: the engine loads the level the node's CPU runs, so one image serves
# any x86-64 node, and nothing is compiled when a pod starts (the operator's pods run read-only as uid 1000).
#
# CUDA: PyPI's Linux torch wheels bundle the CUDA runtime (nvidia-* wheels), so a plain Python base is
# CUDA-capable; the host's NVIDIA container toolkit injects the driver. Triton JIT-compiles a small C
# launcher at run time (into TRITON_CACHE_DIR, under /tmp), hence gcc, but no C++ toolchain, in the final stage.
#
# Build with:  docker build -t ghcr.io/pagedmodel/pagedmodel:0.1.0 .   (BuildKit, Docker's default since 23,
# for RUN --mount; buildah bud works the same)
# BASE_IMAGE: any Debian-based image with Python >= 3.11 and pip; where the public base can't be pulled, a
# Debian bookworm made with mmdebstrap (python3, python3-pip, passwd; PIP_BREAK_SYSTEM_PACKAGES=1) serves:
# `python -m e2e.node.images` builds that base and this image for the e2e tier's real node.
#
# Layers are ordered for rebuilds: the dependencies (torch and its CUDA wheels, ~5 GB) are one layer keyed
# on pyproject.toml alone, so a change to the code rebuilds and moves only the project's own layers.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/pagedmodel pagedmodel
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/pyproject.toml /tmp/requirements.txt

FROM runtime AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir "setuptools>=64" ninja wheel
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY kernels ./kernels
COPY pagedmodel ./pagedmodel
COPY server ./server
COPY operator ./operator
# Our wheel alone, built against the runtime layer's torch (the one the ops will load).
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM runtime
# Our wheel is ~2 MB (the dependencies are in the runtime layer), so a COPY costs nothing, and its content
# keys the layer cache: buildah does not key a RUN on what a bind mount from another stage holds, and a
# code change left the old wheel installed in a rebuilt image.
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/pagedmodel-*.whl && rm -rf /tmp/wheels

# The default model lives in the image, so `builtin://smollm2` needs no network and no writable disk.
# Scratch (Triton/inductor caches, anything under XDG's cache) goes to /tmp, an emptyDir in the operator's
# pods (read-only root); the operator sets the same variables on the pods it makes.
ENV PAGEDMODEL_CACHE_DIR=/opt/pagedmodel/cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    XDG_CACHE_HOME=/tmp/cache \
    HF_HOME=/tmp/huggingface \
    PYTHONUNBUFFERED=1
RUN pagedmodel models pull smollm2 && chmod -R a+rX /opt/pagedmodel

USER 1000:1000
WORKDIR /home/pagedmodel
EXPOSE 8000
ENTRYPOINT ["pagedmodel"]
CMD ["serve", "--host", "0.0.0.0"]
