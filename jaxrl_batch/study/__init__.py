"""Equal-sample studies of a batch family, and throughput sweeps for the planner (`runner`)."""
from jaxrl_batch.study.runner import run_study, throughput_sweep

__all__ = ["run_study", "throughput_sweep"]
