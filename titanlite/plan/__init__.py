"""GPU-free planning of a job's memory and speed: python -m titanlite.plan --job.config_file X.toml."""
