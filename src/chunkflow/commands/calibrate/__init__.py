"""`chunkflow calibrate`: the command (command.py) and, beside it, the measuring, the fit and the profile it writes."""
