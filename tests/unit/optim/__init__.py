"""Unit tests of zerodp.optim (in-process, no process group unless a test makes one)."""
