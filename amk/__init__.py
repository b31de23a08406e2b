"""AMK: a Llama-family model as one statically verified persistent GPU megakernel."""

__version__ = "0.1.0"


def compile(*args, **kwargs):
    """`amk.compile(model=None, config=None, target=None, ...) -> Megakernel` (see `amk.api`)."""
    from amk.api import compile as _compile

    return _compile(*args, **kwargs)
