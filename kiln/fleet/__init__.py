"""The fleet: many Kiln engines as Ray Serve replicas, each session routed to its owner (docs/architecture.md § Fleet)."""
