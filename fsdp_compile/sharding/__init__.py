"""The model side of FSDP, before any graph: process-group layout, bucket units, parameter
shards (a gathering property per parameter), meta-device materialization, gradient-sync state."""
