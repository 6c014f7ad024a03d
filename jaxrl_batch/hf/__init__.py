"""Hugging Face checkpoints (Llama, Qwen2, Qwen3) in and out; needs the `hf` extra (safetensors)."""
from jaxrl_batch.hf.convert import from_pretrained, save_pretrained
from jaxrl_batch.hf.converted import export_hf, import_hf

__all__ = ["export_hf", "from_pretrained", "import_hf", "save_pretrained"]
