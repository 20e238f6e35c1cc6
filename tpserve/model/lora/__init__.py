"""LoRA adapters: PEFT folders read and checked (``adapter``), put on the model's
tensor-parallel layers (``attach``; the layers' side is ``parallel/lora.py``)."""
