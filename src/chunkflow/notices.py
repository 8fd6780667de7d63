"""Third-party notices that say nothing to a chunkflow user, dropped by exact pattern; every other warning passes.

Each is a record of one named logger (the library's own), matched by its whole text: the filter sits on that logger,
so it never sees another library's records, and a message that differs in any part (diffusers naming real float32
modules, transformers missing another backend) is kept. Installed once by the command line (its app callback, before any command runs);
the loggers are the libraries' own even when installed before they are imported."""

from __future__ import annotations

import logging
import re

__all__ = ["KNOWN_HARMLESS", "quiet_known_notices"]

# logger name -> the whole messages dropped from it
KNOWN_HARMLESS: dict[str, tuple[re.Pattern[str], ...]] = {
    # ModelMixin.to(dtype) on a model whose _keep_in_fp32_modules is an empty list: nothing is kept in float32, so
    # nothing can be inconsistent (chunkflow casts each component once, as the plan stores it)
    "diffusers.models.modeling_utils": (
        re.compile(r"There are modules in \w+ that should be kept in float32: \[\]\. Casting directly with `to\(\)` "
                   r"can lead to inconsistent results; set `torch_dtype` in `from_pretrained\(\)` instead to keep "
                   r"these modules in float32\."),),
    # transformers' lazy module, on first touching an image processor without torchvision: it falls back to the
    # PIL class, which is what diffusers' pipelines use anyway (their outputs are the same)
    "transformers.utils.import_utils": (
        re.compile(r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+ImageProcessorPil`"
                   r" for backward compatibility\. Install torchvision to use the default backend, or import "
                   r"`\w+ImageProcessorPil` directly to silence this warning\."),),
}


class _DropKnown(logging.Filter):
    """Drops the records whose message is one of `patterns`, whole."""

    def __init__(self, patterns: tuple[re.Pattern[str], ...]):
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a record that cannot be formatted is not ours to judge
            return True
        return not any(p.fullmatch(text) for p in self.patterns)


def quiet_known_notices() -> None:
    """The filters on their loggers, once (calling it again adds nothing)."""
    for name, patterns in KNOWN_HARMLESS.items():
        logger = logging.getLogger(name)
        # by name: a test or a notebook may import this module afresh, with a class of its own
        if not any(type(f).__name__ == _DropKnown.__name__ for f in logger.filters):
            logger.addFilter(_DropKnown(patterns))
