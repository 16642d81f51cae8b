"""Checkpoints: DCP save / resume (manager.py), the one checked weight loader (weights.py), preemption (stopping.py),
Hugging Face files (hf_io.py), LoRA adapters in checkpoints and PEFT exports (lora.py)."""
