"""The engine model's requests, whoever carries them to the engine: Triton's engine model (tritonllm/backend), or a
front that reaches an engine in its own process directly (tensorrt_llm_bls, the bridge, the OpenAI layer). The
tensors' rules, admission and per-generation outputs are defined here once, free of Triton's Python backend."""
