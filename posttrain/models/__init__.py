"""Model and tokenizer builders: tiny Qwen2-style models built from config, HF tokenizers."""

from posttrain.models.tiny import TINY_PRESETS, build_tiny_model, count_parameters
from posttrain.models.tokenizer import build_char_tokenizer

__all__ = ["TINY_PRESETS", "build_char_tokenizer", "build_tiny_model", "count_parameters"]
