"""LoRA adapters served beside the base model: one step batches rows of many adapters and of the base.

- ``lora_request.py``: how a request names its adapter (vLLM's ``LoRARequest``).
- ``adapter.py``: a PEFT adapter directory read and checked against the model, weights on the CPU.
- ``registry.py``: the adapters this engine knows by name (start-up ``--lora-modules``, runtime loads).
- ``slots.py``: which adapters are resident in the model's ``--max-loras`` slots (pure, scheduler-owned).
- ``layers.py``: the projections' LoRA wrappers and the per-step token-to-slot batch (tensors).
"""
