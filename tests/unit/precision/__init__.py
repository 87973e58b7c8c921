"""Unit tests of zerodp.precision (in-process, no process group unless a test makes one)."""
