"""Mixture-of-experts kernels: the routed experts' SwiGLU MLPs over a flat batch
(fused_experts.py)."""
