"""Predicted step time on hardware we do not have: each compiled program's roofline (`program_time`) and a step's
rollout through the engines' own scheduling (`engine_time`)."""
