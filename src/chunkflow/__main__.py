"""`python -m chunkflow ...`: the same command line as `chunkflow ...`."""

from chunkflow.entry import main

main()
