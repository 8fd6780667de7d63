"""`chunkflow calibrate`: the command (command.py) and what it runs: measure.py (the machine's factors, in one
`calibrate()`), with ops.py (operator rates, VAE decodes), disk.py (disk, page-locking, load start-up) and host.py
(text encoders' host dispatch); fit.py (pure fits from measured times to factors); profile.py (the profile written);
refit.py (`--from-report`: a profile adjusted from run reports)."""
