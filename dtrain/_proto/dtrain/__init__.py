"""Generated protobuf/gRPC modules (scripts/gen_proto.py); do not edit."""
