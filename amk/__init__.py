"""AMK: a Llama-family model as one statically verified persistent GPU megakernel."""

__version__ = "0.1.0"
