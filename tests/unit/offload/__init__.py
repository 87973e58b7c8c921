"""Unit tests of zerodp.offload (in-process, no process group unless a test makes one)."""
