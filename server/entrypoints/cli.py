"""`kvserve` command line. Every flag's default can be set by an environment variable
KVSERVE_<FLAG> (upper case, dashes as underscores), e.g. KVSERVE_PORT=9000."""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace
import os
import sys

from kvserve.engine.config.arg_types import split_keys  # light: imports no torch
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.settings import add_flags, from_args
from kvserve.server.config import ServerConfig

log = logging.getLogger("kvserve")


CLIENT_TOOLS = {"bench": "benchmarks: bench serve|plot load-test an OpenAI-compatible "
                         "server; bench offline|decode|spec|profile run the engine in process",
                "estimate": "roofline: memory, KV capacity, speed and cost on a GPU"}
# `kvserve bench TOOL` for these goes to bench/in_process (the engine in this process);
# every other bench tool to bench/client, which is a client of the HTTP API only.
ENGINE_BENCH_TOOLS = ("offline", "decode", "spec", "profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_flags(serve, EngineConfig)
    add_flags(serve, ServerConfig)
    # Tools parsed by bench/client or bench/in_process: with "\0" as the only prefix
    # character every flag passes through unparsed, and neither package is imported
    # unless one of its tools runs.
    batch = sub.add_parser("run-batch", help="serve a batch file's lines (OpenAI's batch "
                           "format, as vLLM's run-batch) offline, answers into a file")
    batch.add_argument("-i", "--input-file", required=True,
                       help="the requests, one JSON line each (- for stdin)")
    batch.add_argument("-o", "--output-file", required=True,
                       help="where the answers go, one line each, in the input's order")
    add_flags(batch, EngineConfig)
    add_flags(batch, ServerConfig)
    for name, what in CLIENT_TOOLS.items():
        tool = sub.add_parser(name, help=what, add_help=False, prefix_chars="\0")
        tool.add_argument("argv", nargs="*")
    return parser


def engine_config_from_args(args, model_path: str) -> EngineConfig:
    return from_args(EngineConfig, args, model=model_path)


def server_config_from_args(args) -> ServerConfig:
    return from_args(ServerConfig, args)


def resolve_model(args) -> tuple[str, list[str]]:
    """(model directory, served names)."""
    if args.model is None:
        from kvserve.modelstore.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        path, names = str(ensure_default_model()), [DEFAULT_MODEL_NAME]
    else:
        path, names = _local_path(args), [args.model]
        _check_model_arg(path, args.load_format)
    if args.served_model_name:
        names = split_keys([args.served_model_name])
    return path, names


def _local_path(args) -> str:
    """--model, or for a hub id its snapshot in the Hugging Face cache (fetched if
    need be); the served name stays the hub id, as vLLM serves it."""
    from kvserve.modelstore import hub
    from kvserve.modelstore.errors import ModelLoadError

    if not hub.is_hub_id(args.model):
        return args.model
    try:
        return str(hub.fetch(args.model, args.revision))
    except ModelLoadError as exc:
        raise SystemExit(f"kvserve: {exc}") from None


def _check_model_arg(model: str, load_format: str) -> None:
    from kvserve.modelstore.presets import is_preset, resolve_model_path

    if not is_preset(model):
        if model.endswith(".gguf") and os.path.isfile(model):
            return
        if not os.path.isdir(model):
            raise SystemExit(f"kvserve: model directory not found: {model} (kvserve loads "
                             "local Hugging Face model directories, .gguf files, or hub "
                             "ids such as Qwen/Qwen3-0.6B)")
        return
    try:
        resolve_model_path(model)
    except ValueError as exc:
        raise SystemExit(f"kvserve: {exc}") from None
    if load_format != "random":
        raise SystemExit(f"kvserve: {model} is a model shape without weights; "
                         "add --load-format random")


def build_server_app(args, config: ServerConfig):
    """The model's engine (not started) and the app over it; (app, served names)."""
    from kvserve.engine.kernels.attention import AttentionBackendError
    from kvserve.engine.config.model_config import ModelConfigError
    from kvserve.engine.client.launch import start_engine
    from kvserve.engine.weights.cpu_packing import build_in_background
    from kvserve.engine.weights.loader import ModelLoadError
    from kvserve.engine.client.process_engine import EngineStartError
    from kvserve.server.entrypoints.app import build_app

    # The CPU kernels build (g++, off the GIL) while the default model converts and
    # the engine starts; the engine waits for this build rather than start its own.
    build_in_background(args.cpu_kernels, args.device)
    path, names = resolve_model(args)
    try:
        engine = start_engine(engine_config_from_args(args, path), config.engine_mode)
    except (ModelLoadError, ModelConfigError, AttentionBackendError, EngineStartError,
            ValueError) as exc:  # ValueError: settings that contradict each other
        raise SystemExit(f"kvserve: {exc}") from None
    return build_app(engine, names, model_root=path, config=config), names


def _server_config(args, **overrides) -> ServerConfig:
    try:
        return replace(server_config_from_args(args), **overrides)
    except ValueError as exc:  # settings that contradict each other
        raise SystemExit(f"kvserve: {exc}") from None


def serve(args) -> None:
    import uvicorn

    from kvserve.engine.platform.heap import freeze_startup_heap
    from kvserve.server.shutdown import GracefulServer

    config = _server_config(args)
    app, names = build_server_app(args, config)
    guarded = ("/v1, /tokenize, /detokenize" + (", /health, /ready, /version and /metrics"
                                                if config.protect_metrics else ""))
    keys = len(config.api_keys) + len(config.admin_api_keys)
    log.info("serving %s on http://%s:%d%s", ", ".join(names), config.host, config.port,
             f" ({keys} API key(s) required on {guarded})" if keys else "")
    # The drain has already waited for responses in flight; uvicorn's own wait after
    # it only has to outlast stragglers, so it is short.
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port,
                                    log_level=config.log_level, timeout_graceful_shutdown=5,
                                    timeout_keep_alive=config.timeout_keep_alive,
                                    limit_concurrency=config.max_connections or None)
    server = GracefulServer(uvicorn_config, app.state.admission, config.shutdown_timeout)
    freeze_startup_heap()  # the libraries, tokenizer (and in-process model): never garbage
    server.run()
    if server.engine_died:
        # Non-zero, so a supervisor (systemd, Kubernetes) restarts the server.
        raise SystemExit(f"kvserve: the engine died ({app.state.admission.engine.error!r}); "
                         "exiting")


def headless(args) -> int:
    """A node other than 0 of a multi-node group: its ranks, no HTTP."""
    from kvserve.engine.ranks.headless import run_headless

    path, _ = resolve_model(args)
    try:
        return run_headless(engine_config_from_args(args, path))
    except ValueError as exc:
        raise SystemExit(f"kvserve: {exc}") from None


def run_batch(args) -> int:
    """`kvserve run-batch`: its own job folder, gone afterwards (nothing resumes)."""
    import tempfile

    from kvserve.server.batch import offline

    with tempfile.TemporaryDirectory(prefix="kvserve-run-batch-") as scratch:
        config = _server_config(args, batch_dir=scratch)
        app, _ = build_server_app(args, config)
        return offline.main(app, config, args.input_file, args.output_file)


def huge_pages_for_weights() -> None:
    """torch's CPU allocator puts each allocation of 2 MiB or more in transparent huge
    pages when THP_MEM_ALLOC_ENABLE is set before torch is imported (read once): the
    weights, streamed from memory every decode step, then cost a TLB entry every 2
    MiB rather than every 4 KiB. A mixture-of-experts decode step's experts came from
    memory 1.07-1.6x faster so (bench/moe_from_memory.py, 64 experts of 1024 x 384 a
    layer over 24 layers: one token's 8 bf16 ones 0.64 -> 0.46 ms a layer, int8 0.48
    -> 0.41; 16 tokens' int8 ones 4.3 -> 2.7 ms; 2-core Zen 4, THP in `madvise`
    mode). Where the kernel's THP mode is `never` nothing changes;
    THP_MEM_ALLOC_ENABLE=0 keeps 4 KiB pages."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main(argv: list[str] | None = None) -> int | None:
    huge_pages_for_weights()  # first: before anything imports torch
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.argv[:1] and args.argv[0] in ENGINE_BENCH_TOOLS:
        from kvserve.benchmarks.in_process.cli import main as engine_bench_main

        return engine_bench_main(args.argv)
    if args.command in CLIENT_TOOLS:
        from kvserve.benchmarks.client.cli import main as client_main

        return client_main([args.command, *args.argv])
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve" and args.headless:
        return headless(args)
    if args.command == "serve":
        serve(args)
        from kvserve.engine.runner.compile_process import exit_if_compiling

        exit_if_compiling(0)
    elif args.command == "run-batch":
        code = run_batch(args)
        from kvserve.engine.runner.compile_process import exit_if_compiling

        exit_if_compiling(code)
        return code


if __name__ == "__main__":
    sys.exit(main())  # (`python -m`: the exit code main returns, as the script's)
