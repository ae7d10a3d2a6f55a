"""The bottom layer, under the core too: name registries, ConfigError, the libraries' log levels, FLOP and machine
accounting, content fingerprints, a checkpoint folder's file rules, curves over seeds."""
