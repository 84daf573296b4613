"""The engine's configuration, one frozen dataclass per concern: the serving knobs
(engine_config.py, each also a flag through settings.py), the model
(model_config.py), LoRA's and the KV cache events' own (lora_config.py,
kv_events_config.py)."""
