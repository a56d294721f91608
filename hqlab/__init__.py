"""hqlab: a research workbench for speculative decoding on real Qwen models."""

__version__ = "0.1.0"
