"""Run a script or module here as it would import on the GPU machine: every package of
this environment that the machine's image lacks is refused, unless --site holds it
(bench/gpu_wheels.sh's wheels, installed there by bench/gpu_session.sh). A GPU call
is minutes of a 15-minute budget; an ImportError there should be found here first.

  PYVER=3.11 WHEELS=/tmp/whl bash bench/gpu_wheels.sh
  pip install -q --no-deps --target /tmp/site /tmp/whl/*.whl
  python bench/gpu_image_check.py --site /tmp/site bench/gpu_decode.py --preset llama-tiny
  python bench/gpu_image_check.py --site /tmp/site -m pytest -q tests/bench

Or, without downloading anything, with the wheels' list taken as installed there
(what `KVSERVE_GPU_DRY_RUN=1 bash bench/gpu_session.sh` does):

  python bench/gpu_image_check.py --allow-listed bench/gpu_wheels.txt bench/gpu_decode.py

The image's packages are those /work/.library/device/KINDS.md lists (read 2026-11-17)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import runpy
import sys

from packaging.requirements import Requirement

IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler
cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py
onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pyre-extensions pygments pyparsing pyproject-hooks pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"""
OURS = {"bench", "kvserve"}  # the tree


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dependencies(names: set[str]) -> set[str]:
    """names and what they need, as installed here: the image's packages bring their own
    (huggingface_hub here needs httpx2, the image's its own), so those are not refused."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(_norm(requirement.name))
    return found


def listed_in(path: str) -> set[str]:
    """The distributions a requirements file names (bench/gpu_wheels.txt)."""
    lines = (line.split("#")[0].strip() for line in open(path, encoding="utf-8"))
    return {_norm(Requirement(line).name) for line in lines if line}


def absent_distributions(brought: set[str] = frozenset()) -> set[str]:
    """The distributions installed here that the image lacks (normalised names);
    brought: those the session carries as wheels, taken as present."""
    listed = {_norm(n) for n in IMAGE.split()} | brought
    ours = {_norm(Requirement(line).name) for line in importlib.metadata.requires("kvserve")}
    image = listed | (_dependencies(listed) - ours)  # what kvserve asks for: as listed
    installed = {_norm(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    return installed - image - {"kvserve"}


def absent_modules(absent: set[str]) -> set[str]:
    """Top-level modules this environment has from the absent distributions."""
    return {module for module, dists in importlib.metadata.packages_distributions().items()
            if module not in OURS and all(_norm(d) in absent for d in dists)}


def hide_distributions(absent: set[str], site: list[str]) -> None:
    """importlib.metadata.distributions() without the absent ones (pytest loads its
    plugins from their entry points), except those the wheels installed."""
    everything = importlib.metadata.distributions

    def distributions(**kwargs):
        for dist in everything(**kwargs):
            where = str(getattr(dist, "_path", ""))
            if _norm(dist.metadata["Name"]) not in absent or any(where.startswith(d)
                                                                 for d in site):
                yield dist

    importlib.metadata.distributions = distributions


class ImageFinder(importlib.abc.MetaPathFinder):
    """Refuses the absent modules, except those found under `site`."""

    def __init__(self, absent: set[str], site: list[str]):
        self.absent, self.site = absent, site

    def find_spec(self, name, path=None, target=None):
        # A submodule (path set): its package was let through, so it came from the wheels.
        if name.partition(".")[0] not in self.absent or path is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, self.site) if self.site else None
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} on the GPU image", name=name)
        return spec


def main() -> None:
    """[--site DIR]... [--allow-listed FILE]... (SCRIPT | -m MODULE | -c CODE) ARGS...:
    the arguments after the script, module or code are its own (argparse here would
    take its --help)."""
    argv, site, brought = sys.argv[1:], [], set()
    while argv[:1] in (["--site"], ["--allow-listed"]) and len(argv) > 1:
        if argv[0] == "--site":
            site.append(argv[1])
        else:
            brought |= listed_in(argv[1])
        argv = argv[2:]
    flag = argv[0] if argv[:1] in (["-m"], ["-c"]) and len(argv) > 1 else None
    if not argv or argv[0].startswith("-") and flag is None:
        sys.exit(__doc__)
    dists = absent_distributions(brought)
    absent = absent_modules(dists)
    hide_distributions(dists, site)
    for name in [m for m in sys.modules if m.partition(".")[0] in absent]:
        del sys.modules[name]  # imported at start-up (site hooks): import them again
    sys.meta_path.insert(0, ImageFinder(absent, site))
    if flag == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif flag == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
