"""gRPC API definition: `ironlm.proto` and the Python modules generated from it (see the .proto header)."""
