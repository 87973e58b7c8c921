"""Unit tests of zerodp.tensor_parallel (in-process, no process group unless a test makes one)."""
