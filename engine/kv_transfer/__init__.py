"""Prefill/decode disaggregation (--kv-transfer-config): a prefill instance computes
a prompt's KV and keeps its blocks pinned (producer.py); the decode instance the
router sends the same request to reads those blocks straight out of the prefill's
KV cache with Mooncake's transfer engine (transport.py), one batch read, and puts
them in its second KV tier, where its prefix lookup finds them (consumer.py). The
two meet over a small ZMQ side channel (side_channel.py) that names the blocks;
block_layout.py says where each block's bytes lie. connector.py is the engine
loop's one entry point. Anything that fails on the way ends as a recompute, never
as a lost request."""
