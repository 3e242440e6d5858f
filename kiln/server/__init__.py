"""Serving: one process, one engine, gRPC (grpc.py) and HTTP (http.py) over the shared RuntimeService."""
