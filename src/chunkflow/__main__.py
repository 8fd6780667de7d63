"""`python -m chunkflow ...`: the same command line as `chunkflow ...`."""

from chunkflow.cli import main

main()
