"""Training: the RL loop (`trainer`), the rollout collector, setup, evaluation, the SFT warm start and the
run directory (`rundir`)."""
