"""`genmesh up`: a whole mesh on one machine, each service its own OS process
(`config.py`: its options; `run.py`: starting, watching and stopping it)."""
