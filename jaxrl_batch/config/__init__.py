"""Configuration: the argument parser of config files (`args`), batch families and the derived `Member` (`family`),
and the optimizer (`optim`)."""
