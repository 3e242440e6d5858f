"""Persistence of sessions: content-addressed KV snapshots (manifest + page blobs), their stores (a local
directory, Redis), verified restore, and the background saver. See docs/architecture.md § Snapshots."""
