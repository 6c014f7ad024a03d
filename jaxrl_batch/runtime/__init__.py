"""Runtime: device mesh and sharding rules, the multi-process runtime, orbax checkpoints, named random streams
and the named host<->device transfers of a step."""
