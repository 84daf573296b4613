"""Multi-LoRA serving (issue 22): PEFT adapters read and checked (adapter.py) and the
batched LoRA product over a flat step (batched.py). Not wired into the model yet."""
