"""Unit tests of zerodp.optimizers (in-process, no process group unless a test makes one)."""
