"""The compile driver: argument checks, the decisions every rank agrees on, compiles
shared across ranks, MpmdCompiled, and reads of values across ranks."""
