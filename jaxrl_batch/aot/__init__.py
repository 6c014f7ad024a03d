"""The compile-only analysis: one RL step's programs, as a run of the config executes them (`train.step_builder`),
compiled for a TPU slice or GPU node this machine does not have, from abstract shapes (`check`, `launch.aot_check`),
and the decode step against its HBM roofline (`decode_roofline`, `launch.decode_roofline`)."""
from jaxrl_batch.aot.abstract_step import AbstractStep, abstract_experiment
from jaxrl_batch.aot.check import check
from jaxrl_batch.aot.engine_inputs import engine_inputs
from jaxrl_batch.aot.programs import FUNCTIONS, PROGRAMS, Copy, Program, program
from jaxrl_batch.aot.report import GIB, Cost, Memory, ProgramReport, Report, cost_of, parse_oom, per_chip_bytes

__all__ = ["AbstractStep", "Copy", "Cost", "FUNCTIONS", "GIB", "Memory", "PROGRAMS", "Program", "ProgramReport",
           "Report", "abstract_experiment", "check", "cost_of", "engine_inputs", "parse_oom", "per_chip_bytes",
           "program"]
