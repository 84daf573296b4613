"""The engine, in layers; each folder imports only the folders below it
(tests/test_layering.py holds the rule), from the bottom:

- platform/: what every layer stands on: the device, the dtype and the CPU's flags,
  host-to-device copies, fault points, the start-up heap, GGUF files, and the
  records a request gets back (RequestOutput);
- config/: what the engine is asked to do (EngineConfig and its flags) and what the
  model is (ModelConfig);
- kernels/: kvserve's own kernels: the CPU library (C++), the attention backends
  (torch, Triton, flash-attn), LoRA's Triton kernels;
- models/: the model code: the decoder, its layers, tensor-parallel layers,
  quantized layer kinds, the KV cache tensors, a step's LoRA inputs;
- weights/: a model loaded: checkpoints (safetensors, GGUF), quantized at load and
  calibrated, packed for the CPU kernels;
- structured/, sampling/, lora/, spec_decode/: grammars and their masks, sampling
  and draft verification, the LoRA adapters' registry, speculative decoding's
  proposers;
- ranks/: the other tensor-parallel ranks' processes and the channel that feeds them;
- kv_offload/: the second KV tier: evicted prefix blocks in host memory and on disk,
  copied back into the cache before the step that reads them;
- runner/: one step on the device: batches, the forward path (eager, compiled, CUDA
  graphs), sampling's launch;
- core/: the engine itself and the one place that builds it;
- kv_transfer/: prefill/decode disaggregation: a prefill instance's finished
  prompts' blocks held for, and read by, a decode instance (Mooncake's transfer
  engine), seen by the engine loop;
- client/: the server's side of the engine, on a thread or in a process.
"""
