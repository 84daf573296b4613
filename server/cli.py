"""`kvserve` command line. Every flag's default can be set by an environment variable
KVSERVE_<FLAG> (upper case, dashes as underscores), e.g. KVSERVE_PORT=9000."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.arg_types import parse_bool, parse_size  # light: imports no torch

log = logging.getLogger("kvserve")


def _non_negative(type_):
    def parse(text: str):
        value = type_(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
        return value
    parse.__name__ = type_.__name__  # argparse names the type in its messages
    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def split_keys(values) -> list[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c']; blanks dropped."""
    return [k.strip() for v in values for k in str(v).split(",") if k.strip()]


class _KeyList(argparse.Action):
    """A repeatable, comma-separated list: `--api-key a,b --api-key c` -> [a, b, c].
    Given flags replace the default taken from the environment, as other flags do."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        keys = [] if current is self.default else list(current)
        setattr(namespace, self.dest, keys + split_keys([values]))


def _env_name(flag: str) -> str:
    return "KVSERVE_" + flag.lstrip("-").upper().replace("-", "_")


class _EnvDefaults:
    """Adds flags whose default comes from KVSERVE_* when set."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def add_secret_list(self, flag: str, help: str = ""):
        """A _KeyList flag whose values --help never shows."""
        env = _env_name(flag)
        default = split_keys([os.environ[env]]) if env in os.environ else []
        shown = "set" if default else "none"
        self.parser.add_argument(flag, default=default, action=_KeyList,
                                 help=f"{help} [env {env}; default: {shown}]")

    def add(self, flag: str, default=None, type=str, help: str = "", **kw):
        env = _env_name(flag)
        if env in os.environ:
            # argparse converts a string default with `type` itself, so a bad value is a
            # usage error naming the flag rather than a traceback.
            default = os.environ[env]
        self.parser.add_argument(flag, default=default, type=type,
                                 help=f"{help} [env {env}; default: {default}]", **kw)


CLIENT_TOOLS = {"bench": "benchmarks: bench serve|plot load-test an OpenAI-compatible "
                         "server; bench offline|decode|spec run the engine in process",
                "estimate": "roofline: memory, KV capacity, speed and cost on a GPU"}
# `kvserve bench TOOL` for these goes to engine/benchmarks (the engine in this process);
# every other bench tool to kvbench, which is a client of the HTTP API only.
ENGINE_BENCH_TOOLS = ("offline", "decode", "spec")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_args(_EnvDefaults(serve))
    # Tools parsed by kvbench or engine/benchmarks: with "\0" as the only prefix
    # character every flag passes through unparsed, and neither package is imported
    # unless one of its tools runs.
    for name, what in CLIENT_TOOLS.items():
        tool = sub.add_parser(name, help=what, add_help=False, prefix_chars="\0")
        tool.add_argument("argv", nargs="*")
    return parser


def add_serve_args(p: _EnvDefaults) -> None:
    p.add("--model", None, help="Hugging Face model directory, or preset:NAME for a "
          "shipped model shape with --load-format random (llama-3.2-1b, llama-3.1-8b, "
          "llama-tiny) (default: the embedded SmolLM2-135M-Instruct, converted once "
          "into the cache)")
    p.add("--served-model-name", None, help="name(s) clients use, comma-separated")
    p.add("--host", "127.0.0.1", help="address to bind")
    p.add("--port", 8000, type=int, help="port to bind")
    p.add("--dtype", "auto", choices=["auto", "float32", "bfloat16", "float16"],
          help="weights and KV cache (auto: bf16 on CUDA, fp32 on CPU)")
    p.add("--device", "auto", help="auto|cpu|cuda")
    p.add("--max-model-len", None, type=int, help="context length cap")
    p.add("--block-size", 16, type=int, help="tokens per KV-cache block")
    p.add("--kv-cache-memory", None, type=parse_size,
          help="KV cache size (default: on CUDA what --gpu-memory-utilization leaves "
          "after weights and a profiled peak step; on CPU 1GiB)")
    p.add("--gpu-memory-utilization", 0.9, type=float,
          help="share of the GPU's memory kvserve may use (weights, activations, KV)")
    p.add("--num-kv-blocks", None, type=int, help="KV cache size in blocks (overrides memory)")
    p.add("--max-num-seqs", 64, type=int, help="most requests running at once")
    p.add("--max-num-batched-tokens", 512, type=int, help="token budget of one step")
    p.add("--long-prefill-token-threshold", 0, type=int,
          help="most tokens one request may compute in a step (0: no cap)")
    p.add("--scheduling-policy", "fcfs", choices=["fcfs", "priority"],
          help="admission order (priority: lower `priority` first)")
    p.add("--enable-prefix-caching", True, type=parse_bool, help="share cached prompt prefixes")
    p.add("--load-format", "safetensors", choices=["safetensors", "random"],
          help="read the checkpoint, or random weights of its shape")
    p.add("--seed", 0, type=int, help="global random seed")
    p.add("--attention-backend", "auto", choices=["auto", "triton", "flash-attn", "torch"],
          help="attention kernels (auto: triton on CUDA, torch on CPU; flash-attn needs "
          "the flash_attn package and a --block-size multiple of 256)")
    p.add("--enforce-eager", False, type=parse_bool,
          help="no CUDA graphs for decode steps (they are captured on CUDA otherwise)")
    p.add("--async-scheduling", False, type=parse_bool,
          help="plan and launch each step while the previous one runs on the device "
          "(hides the scheduler's time; not with speculative decoding)")
    add_speculative_args(p)
    p.add("--engine-mode", "auto", choices=["auto", "thread", "process"],
          help="where the engine runs: a thread of the server, or a process of its own "
          "(auto: process on CUDA, thread on CPU)")
    p.add("--log-level", "info", help="debug|info|warning|error")
    p.add_secret_list("--api-key", help="require `Authorization: Bearer <key>` on /v1 "
                      "routes; comma-separated and/or repeated for several keys")
    p.add("--protect-metrics", False, type=parse_bool,
          help="require the API key on /health, /version and /metrics too (needs "
          "--api-key; probes and scrapers must then send it)")
    p.add("--max-waiting-requests", 0, type=_non_negative(int),
          help="answer 429 to new generation requests while this many wait to be "
          "scheduled (0: no limit)")
    p.add("--max-waiting-tokens", 0, type=_non_negative(int),
          help="answer 429 to new generation requests while the prompts waiting to be "
          "scheduled (queued, not yet prefilled) hold this many tokens (0: no limit)")
    p.add("--max-request-body-bytes", 10 * 2**20, type=_non_negative(int),
          help="answer 413 to a request body larger than this (0: no limit)")
    p.add("--max-prompts-per-request", 1024, type=_non_negative(int),
          help="most prompts in one /v1/completions list prompt (0: no limit)")
    p.add("--max-n", 16, type=_positive_int, help="most choices (`n`) one request may ask for")
    p.add("--request-timeout", 0.0, type=_non_negative(float),
          help="seconds a generation request may run; then it is aborted and its "
          "choices end with finish reason \"abort\", keeping the text made so far "
          "(0: no limit)")
    p.add("--timeout-keep-alive", 5.0, type=_non_negative(float),
          help="seconds an idle HTTP keep-alive connection stays open (uvicorn's and "
          "vLLM's default: 5); a client pool that keeps idle connections as long or "
          "longer can send a request on one just as the server closes it")
    p.add("--shutdown-timeout", 30.0, type=_non_negative(float),
          help="seconds in-flight requests may run after SIGTERM/SIGINT before they "
          "are aborted")


def add_speculative_args(p: _EnvDefaults) -> None:
    p.add("--speculative-method", "none", choices=["none", "ngram", "early-exit", "draft"],
          help="speculative decoding: ngram (prompt lookup: drafts copied from the "
          "request's own context), early-exit (the model's first --draft-layers "
          "layers draft) or draft (--speculative-model drafts); outputs are unchanged, "
          "only faster")
    p.add("--speculative-model", None,
          help="a smaller model with the same vocabulary that drafts (implies "
          "--speculative-method draft)")
    p.add("--num-speculative-tokens", 4, type=_positive_int,
          help="drafts verified per request per step")
    p.add("--draft-layers", 0, type=_non_negative(int),
          help="early-exit: layers the draft runs (0: a quarter of the model's)")
    p.add("--speculative-disable-batch-size", 8, type=_non_negative(int),
          help="no drafts while more requests than this run: big batches already use "
          "the hardware (0: never switch off)")
    p.add("--ngram-prompt-lookup-max", 4, type=_positive_int,
          help="ngram: longest context suffix matched")
    p.add("--ngram-prompt-lookup-min", 2, type=_positive_int,
          help="ngram: shortest context suffix matched")


def speculative_config_from_args(args):
    method = "draft" if args.speculative_model else args.speculative_method
    if method == "none":
        return None
    from engine.spec_decode.config import SpeculativeConfig

    return SpeculativeConfig(
        method, model=args.speculative_model, num_tokens=args.num_speculative_tokens,
        disable_batch_size=args.speculative_disable_batch_size,
        ngram_max=args.ngram_prompt_lookup_max, ngram_min=args.ngram_prompt_lookup_min,
        draft_layers=args.draft_layers)


def engine_config_from_args(args, model_path: str):
    from engine.config import EngineConfig

    return EngineConfig(
        model=model_path, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching, load_format=args.load_format,
        seed=args.seed, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        speculative=speculative_config_from_args(args),
        async_scheduling=args.async_scheduling)


def resolve_model(args) -> tuple[str, list[str]]:
    """(model directory, served names)."""
    if args.model is None:
        from engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        path, names = str(ensure_default_model()), [DEFAULT_MODEL_NAME]
    else:
        path, names = args.model, [args.model]
        _check_model_arg(path, args.load_format)
    if args.served_model_name:
        names = [n.strip() for n in args.served_model_name.split(",") if n.strip()]
    return path, names


def _check_model_arg(model: str, load_format: str) -> None:
    from engine.presets import is_preset, resolve_model_path

    if not is_preset(model):
        if not os.path.isdir(model):
            raise SystemExit(f"kvserve: model directory not found: {model} (kvserve loads "
                             "local Hugging Face model directories; it downloads nothing)")
        return
    try:
        resolve_model_path(model)
    except ValueError as exc:
        raise SystemExit(f"kvserve: {exc}") from None
    if load_format != "random":
        raise SystemExit(f"kvserve: {model} is a model shape without weights; "
                         "add --load-format random")


def serve(args) -> None:
    import uvicorn

    from engine.attention import AttentionBackendError
    from engine.config import ModelConfigError
    from engine.launch import start_engine
    from engine.loader import ModelLoadError
    from engine.process_engine import EngineStartError
    from server.app import build_app
    from server.limits import RequestLimits
    from server.shutdown import GracefulServer

    if args.protect_metrics and not args.api_key:
        raise SystemExit("kvserve: --protect-metrics needs --api-key (or KVSERVE_API_KEY)")
    path, names = resolve_model(args)
    try:
        engine = start_engine(engine_config_from_args(args, path), args.engine_mode)
    except (ModelLoadError, ModelConfigError, AttentionBackendError, EngineStartError,
            ValueError) as exc:  # ValueError: settings that contradict each other
        raise SystemExit(f"kvserve: {exc}") from None
    limits = RequestLimits(args.max_request_body_bytes, args.max_prompts_per_request,
                           args.max_n)
    app = build_app(engine, names, model_root=path, api_keys=args.api_key,
                    max_waiting_requests=args.max_waiting_requests,
                    max_waiting_tokens=args.max_waiting_tokens, limits=limits,
                    request_timeout=args.request_timeout, protect_metrics=args.protect_metrics)
    guarded = "/v1, /health, /version and /metrics" if args.protect_metrics else "/v1"
    log.info("serving %s on http://%s:%d%s", ", ".join(names), args.host, args.port,
             f" ({len(args.api_key)} API key(s) required on {guarded})" if args.api_key else "")
    # The drain has already waited for responses in flight; uvicorn's own wait after
    # it only has to outlast stragglers, so it is short.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5,
                            timeout_keep_alive=args.timeout_keep_alive)
    server = GracefulServer(config, app.state.admission, args.shutdown_timeout)
    server.run()
    if server.engine_died:
        # Non-zero, so a supervisor (systemd, Kubernetes) restarts the server.
        raise SystemExit(f"kvserve: the engine died ({engine.error!r}); exiting")


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.argv[:1] and args.argv[0] in ENGINE_BENCH_TOOLS:
        from engine.benchmarks.cli import main as engine_bench_main

        return engine_bench_main(args.argv)
    if args.command in CLIENT_TOOLS:
        from kvbench.cli import main as kvbench_main

        return kvbench_main([args.command, *args.argv])
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
