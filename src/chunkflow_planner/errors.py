"""The package's one error base: a problem with what the user gave, with a message that says what was wrong and
what to do. The CLI turns every ChunkflowError into that message and exit code 2; anything else is a bug."""


class ChunkflowError(ValueError):
    """Bad input or an impossible request; the message names the flag, field or file and what to do instead."""
