"""The command layer: `chunkflow plan`, `run`, `bench`, `calibrate` and the command line that dispatches them.

Everything here may import the library below it (chunkflow.runtime, chunkflow.models, chunkflow.loading, the
planner, the library modules at chunkflow's top level); nothing below imports anything here."""
