"""The second KV tier the flags ask for, attached to the runner (None: off)."""
from __future__ import annotations

import logging
from pathlib import Path

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.kv_offload.disk_blocks import DiskBlocks
from kvserve.engine.kv_offload.host_tier import HostKVTier, block_bytes, layout_key
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.kv_offload")


def _what_computes_the_kv(config: EngineConfig) -> str:
    """What a block's KV depends on besides its tokens (the hashes hold those, the
    salt and the adapter): the model's files as they are now (a checkpoint replaced
    under the same path gets a directory of its own), and the flags that change the
    weights or the cache's numbers (an fp8 cache's scales come from the weights)."""
    path = Path(config.model)
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    stamps = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return repr((str(path.resolve()), stamps, config.dtype, config.kv_cache_dtype,
                 config.quantization, config.load_format, config.seed,
                 config.speculative))


# A decode instance without --kv-offload-bytes still needs a tier to receive a
# prefill's blocks in: room for this many whole-context prompts in flight at once.
RECEIVE_CONTEXTS = 4
RECEIVE_MIN_BYTES = 256 << 20


def make_kv_tier(config: EngineConfig, runner, tensor_parallel: bool,
                 pipeline: bool, layer_groups: bool, max_model_len: int
                 ) -> HostKVTier | None:
    """The second tier --kv-offload-bytes asks for, or a decode instance's
    (--kv-transfer-config) receiving tier; refuses what neither works with."""
    pd = config.kv_transfer_config
    if not config.kv_offload_bytes:
        if config.kv_offload_dir:
            raise ModelLoadError("--kv-offload-dir needs --kv-offload-bytes (the host "
                                 "memory blocks pass through on their way to disk)")
        if pd is None:
            return None
    _refuse(config, tensor_parallel, pipeline and pd is not None, layer_groups)
    caches = runner.all_kv_caches
    if not config.kv_offload_bytes:  # P/D only
        if not pd.consumes:
            return None
        blocks = RECEIVE_CONTEXTS * -(-max_model_len // config.block_size)
        tier = HostKVTier(caches, max(RECEIVE_MIN_BYTES, blocks * block_bytes(caches)),
                          keep_evicted=False)
        runner.kv_tier = tier
        log.info("KV transfer: %d blocks of %d KiB in host memory receive prefills' KV",
                 tier.capacity_blocks, tier.block_bytes >> 10)
        return tier
    disk = (DiskBlocks(config.kv_offload_dir,
                       layout_key(_what_computes_the_kv(config), config.block_size, caches),
                       config.kv_offload_disk_bytes)
            if config.kv_offload_dir else None)
    try:
        tier = HostKVTier(caches, config.kv_offload_bytes, disk)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    runner.kv_tier = tier  # its queued copies run before each step
    log.info("second KV tier: %d blocks of %d KiB in host memory%s", tier.capacity_blocks,
             tier.block_bytes >> 10,
             f", up to {config.kv_offload_disk_bytes >> 20} MiB on disk in {disk.dir}"
             if disk is not None else "")
    return tier


def _refuse(config: EngineConfig, tensor_parallel: bool, pipeline: bool,
            layer_groups: bool) -> None:
    refused = {
        "prefix caching off (--enable-prefix-caching false)":
            not config.enable_prefix_caching,
        "tensor parallelism (each rank's share of a block would need saving)":
            tensor_parallel,
        "pipeline parallelism (each stage holds only its layers' blocks)": pipeline,
        "a hybrid model's layer groups (--disable-hybrid-kv-cache-manager keeps one)":
            layer_groups,
    }
    refused = [what for what, on in refused.items() if on]
    if refused:
        flag = "--kv-offload-bytes" if config.kv_offload_bytes else "--kv-transfer-config"
        raise ModelLoadError(f"{flag} does not work with {', '.join(refused)} yet")
