"""Generated gRPC stubs of proto/kiln/v1/runtime.proto (regenerate with `make proto`; never edit by hand)."""
